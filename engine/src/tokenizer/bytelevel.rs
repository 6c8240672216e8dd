//! The GPT-2 byte-level alphabet: every byte 0..=255 is written as one printable Unicode character in vocabulary
//! strings (`' '` → `'Ġ'`, `'\n'` → `'Ċ'`, printable ASCII stays itself).
//!
//! [`token_bytes`] turns a vocabulary string into the bytes it stands for, with the same rule as the Hugging Face
//! ByteLevel decoder: if every character of the string is in the alphabet, map each one to its byte; otherwise
//! (added tokens such as `<｜User｜>`) the string's own UTF-8 bytes are used. Never panics.

use std::sync::OnceLock;

/// Byte → alphabet character.
pub fn byte_to_char_table() -> &'static [char; 256] {
    static T: OnceLock<[char; 256]> = OnceLock::new();
    T.get_or_init(|| {
        let mut table = ['\0'; 256];
        let mut extra = 0u32;
        for b in 0..256u32 {
            let printable =
                (b'!' as u32..=b'~' as u32).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
            let cp = if printable {
                b
            } else {
                extra += 1;
                255 + extra
            };
            // Every code point here is below 0x200, so `from_u32` cannot fail.
            table[b as usize] = char::from_u32(cp).unwrap_or('\u{FFFD}');
        }
        table
    })
}

/// Alphabet character → byte, or `None` for characters outside the alphabet.
pub fn char_to_byte(c: char) -> Option<u8> {
    let cp = c as u32;
    if cp > 0x1FF {
        return None;
    }
    let t = byte_to_char_table();
    // The table is a bijection onto 256 code points below 0x144; a linear scan of 256 entries is only used for
    // the non-identity part.
    if (b'!' as u32..=b'~' as u32).contains(&cp) || (0xA1..=0xAC).contains(&cp) || (0xAE..=0xFF).contains(&cp) {
        return Some(cp as u8);
    }
    t.iter().position(|&x| x == c).map(|b| b as u8)
}

/// The bytes a vocabulary string decodes to (see the module doc).
pub fn token_bytes(piece: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(piece.len());
    for c in piece.chars() {
        match char_to_byte(c) {
            Some(b) => out.push(b),
            None => return piece.as_bytes().to_vec(),
        }
    }
    out
}

/// True when `piece` is a single character of the alphabet (a base token of byte-level BPE).
pub fn is_single_byte_char(piece: &str) -> bool {
    let mut it = piece.chars();
    matches!((it.next(), it.next()), (Some(c), None) if char_to_byte(c).is_some())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alphabet_is_a_bijection() {
        let t = byte_to_char_table();
        for b in 0..=255u8 {
            assert_eq!(char_to_byte(t[b as usize]), Some(b), "byte {b}");
        }
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[b'a' as usize], 'a');
    }

    #[test]
    fn token_bytes_rule() {
        assert_eq!(token_bytes("Ġthe"), b" the");
        assert_eq!(token_bytes("<｜User｜>"), "<｜User｜>".as_bytes());
        assert_eq!(token_bytes("<think>"), b"<think>");
        // 'ä' is in the alphabet (0xE4) and stands for one raw byte.
        assert_eq!(token_bytes("ä"), vec![0xE4]);
        assert!(is_single_byte_char("Ġ"));
        assert!(!is_single_byte_char("Ġt"));
        assert!(!is_single_byte_char("｜"));
    }
}

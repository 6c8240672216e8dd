//! The `.page` / `.ckpt` file format: self-describing header, layout table with a CRC32 per row block, payload.
//!
//! ```text
//! header, 128 bytes, little-endian
//!   0  [u8;8]  magic "DS4KV\0\r\n"
//!   8  u16     version = 1
//!  10  u8      kind: 1 page, 2 checkpoint
//!  11  u8      save reason: 0 unknown, 1 cold, 2 continued, 3 evict, 4 shutdown, 5 system block
//!  12  u32     identity text length
//!  16  [u8;20] model identity hash
//!  36  [u8;20] key (the file name stem)
//!  56  [u8;20] parent key (page: previous page or chain root; checkpoint: the last full page or root)
//!  76  u32     page span in tokens
//!  80  u64     token start (tokens before this entry)
//!  88  u32     token count (page: the span; checkpoint: tail tokens after the last full page)
//!  92  u32     groups (layers for a page; whatever the engine chose for a checkpoint)
//!  96  u32     row blocks in all groups
//! 100  u64     created, unix seconds
//! 108  u64     payload bytes
//! 116  u32     layout bytes
//! 120  u32     CRC32 of bytes 0..120, 124..128 and the layout
//! 124  u32     reserved (0)
//! layout: identity text; token ids (u32 each); per group its block count (u32); per block 32 bytes:
//!         tag u32, rows u32, width u32, encoding u8, 3 reserved, payload bytes u64, CRC32 u32, reserved u32
//! payload: the blocks' encoded bytes, in layout order
//! ```
//! The file size must be exactly `128 + layout + payload`. The header CRC is checked whenever a header is read; each
//! block's CRC is checked before its rows are decoded and handed to the caller, so a bit flip anywhere is caught
//! and a reader never holds more than one block. Writers stream too ([`write_entry`]): the header is written last
//! (seek back), which is fine because files only become visible by an atomic rename (see `disk`).

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

use crate::codec::{self, Encoding};
use crate::error::{KvError, KvResult as Result};
use crate::key::Key;

/// File magic.
pub const MAGIC: [u8; 8] = *b"DS4KV\0\r\n";
/// Format version written and accepted.
pub const VERSION: u16 = 1;
/// Fixed header size.
pub const HEADER_BYTES: usize = 128;
const BLOCK_DESC_BYTES: usize = 32;
const MAX_TOKENS: u32 = 1 << 24;
const MAX_GROUPS: u32 = 1 << 16;
const MAX_BLOCKS: u32 = 1 << 20;
const MAX_IDENTITY: u32 = 1 << 16;

/// Page or checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub enum EntryKind {
    /// Shareable rows of one token span.
    Page,
    /// A session's resumable tail state at a position.
    Checkpoint,
}

impl EntryKind {
    /// File extension (without dot).
    pub fn ext(self) -> &'static str {
        match self {
            EntryKind::Page => "page",
            EntryKind::Checkpoint => "ckpt",
        }
    }
    fn id(self) -> u8 {
        match self {
            EntryKind::Page => 1,
            EntryKind::Checkpoint => 2,
        }
    }
}

/// Why an entry was saved (the server's trigger), kept for listings and policy tuning.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, serde::Serialize)]
pub enum SaveReason {
    /// Not given.
    #[default]
    Unknown,
    /// A new long prompt missed the cache.
    Cold,
    /// Every N tokens of a live session.
    Continued,
    /// The session is being dropped from RAM.
    Evict,
    /// Clean server shutdown.
    Shutdown,
    /// The end of a long system prompt + tools block (the rendered prefix before the first user message), which
    /// every conversation of the same agent shares.
    SystemBlock,
}

impl SaveReason {
    fn id(self) -> u8 {
        self as u8
    }
    fn from_id(id: u8) -> SaveReason {
        match id {
            1 => SaveReason::Cold,
            2 => SaveReason::Continued,
            3 => SaveReason::Evict,
            4 => SaveReason::Shutdown,
            5 => SaveReason::SystemBlock,
            _ => SaveReason::Unknown,
        }
    }
}

/// One block of rows supplied by the engine: `rows × width` f32 values, row-major. `tag` is the engine's label
/// (e.g. 0 = compressed KV rows, 1 = indexer rows); the store keeps it and hands it back.
#[derive(Clone, Copy, Debug)]
pub struct RowBlock<'a> {
    /// Engine-defined label.
    pub tag: u32,
    /// Row count.
    pub rows: u32,
    /// Values per row.
    pub width: u32,
    /// `rows * width` values.
    pub values: &'a [f32],
}

/// A block as described in a file's layout.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct BlockDesc {
    /// Group (layer) index.
    pub group: u32,
    /// Engine label.
    pub tag: u32,
    /// Row count.
    pub rows: u32,
    /// Values per row.
    pub width: u32,
    /// Stored encoding.
    pub encoding: Encoding,
    /// Encoded bytes.
    pub bytes: u64,
    /// CRC32 of the encoded bytes.
    pub crc: u32,
}

/// A parsed header plus layout.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Header {
    /// Page or checkpoint.
    pub kind: EntryKind,
    /// Save trigger.
    pub reason: SaveReason,
    /// Model identity text.
    pub identity: String,
    /// Model identity hash.
    #[serde(serialize_with = "ser_key")]
    pub model: Key,
    /// This entry's key.
    #[serde(serialize_with = "ser_key")]
    pub key: Key,
    /// Parent key.
    #[serde(serialize_with = "ser_key")]
    pub parent: Key,
    /// Page span of the store that wrote it.
    pub span_tokens: u32,
    /// Tokens before this entry.
    pub token_start: u64,
    /// This entry's token ids.
    pub tokens: Vec<u32>,
    /// Group count.
    pub groups: u32,
    /// Blocks, in file order.
    pub blocks: Vec<BlockDesc>,
    /// Creation time, unix seconds.
    pub created: u64,
    /// Payload bytes.
    pub payload_bytes: u64,
    /// Layout bytes.
    pub layout_bytes: u32,
}

fn ser_key<S: serde::Serializer>(k: &Key, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(&k.hex())
}

impl Header {
    /// Total file size this header implies.
    pub fn file_bytes(&self) -> u64 {
        HEADER_BYTES as u64 + self.layout_bytes as u64 + self.payload_bytes
    }
}

/// Everything about an entry except its rows, for [`write_entry`].
#[derive(Clone, Debug)]
pub struct EntryMeta<'a> {
    /// Page or checkpoint.
    pub kind: EntryKind,
    /// Save trigger.
    pub reason: SaveReason,
    /// Model identity text.
    pub identity: &'a str,
    /// Model identity hash.
    pub model: Key,
    /// Key.
    pub key: Key,
    /// Parent key.
    pub parent: Key,
    /// Store page span.
    pub span_tokens: u32,
    /// Tokens before this entry.
    pub token_start: u64,
    /// This entry's tokens.
    pub tokens: &'a [u32],
    /// Unix seconds.
    pub created: u64,
}

/// Checks that every block's `values.len() == rows * width` and the counts fit the format.
pub fn validate_groups(groups: &[Vec<RowBlock<'_>>]) -> Result<()> {
    if groups.len() as u64 > MAX_GROUPS as u64 {
        return Err(KvError::Invalid(format!("{} groups (max {MAX_GROUPS})", groups.len())));
    }
    let n: usize = groups.iter().map(|g| g.len()).sum();
    if n as u64 > MAX_BLOCKS as u64 {
        return Err(KvError::Invalid(format!("{n} row blocks (max {MAX_BLOCKS})")));
    }
    for (gi, g) in groups.iter().enumerate() {
        for (bi, b) in g.iter().enumerate() {
            if b.rows as u64 * b.width as u64 != b.values.len() as u64 {
                return Err(KvError::Invalid(format!(
                    "group {gi} block {bi}: {} rows x {} width != {} values",
                    b.rows,
                    b.width,
                    b.values.len()
                )));
            }
        }
    }
    Ok(())
}

fn layout_bytes(identity: usize, tokens: usize, groups: usize, blocks: usize) -> usize {
    identity + tokens * 4 + groups * 4 + blocks * BLOCK_DESC_BYTES
}

/// Writes a complete entry to `w` (positioned at 0), streaming one encoded block at a time. Returns the header.
pub fn write_entry<W: Write + Seek>(
    w: &mut W,
    path: &Path,
    meta: &EntryMeta<'_>,
    groups: &[Vec<RowBlock<'_>>],
) -> Result<Header> {
    validate_groups(groups)?;
    if meta.tokens.len() as u64 > MAX_TOKENS as u64 || meta.identity.len() as u64 > MAX_IDENTITY as u64 {
        return Err(KvError::Invalid("too many tokens or identity text too long".into()));
    }
    let n_blocks: usize = groups.iter().map(|g| g.len()).sum();
    let layout_len = layout_bytes(meta.identity.len(), meta.tokens.len(), groups.len(), n_blocks);
    let io = |op: &'static str| move |e| KvError::io(op, path, e);
    w.write_all(&vec![0u8; HEADER_BYTES + layout_len]).map_err(io("write"))?;
    let mut blocks = Vec::with_capacity(n_blocks);
    let mut payload = 0u64;
    for (gi, g) in groups.iter().enumerate() {
        for b in g {
            let (encoding, bytes) = codec::encode(b.values);
            w.write_all(&bytes).map_err(io("write"))?;
            payload += bytes.len() as u64;
            blocks.push(BlockDesc {
                group: gi as u32,
                tag: b.tag,
                rows: b.rows,
                width: b.width,
                encoding,
                bytes: bytes.len() as u64,
                crc: crc32fast::hash(&bytes),
            });
        }
    }
    let header = Header {
        kind: meta.kind,
        reason: meta.reason,
        identity: meta.identity.to_string(),
        model: meta.model,
        key: meta.key,
        parent: meta.parent,
        span_tokens: meta.span_tokens,
        token_start: meta.token_start,
        tokens: meta.tokens.to_vec(),
        groups: groups.len() as u32,
        blocks,
        created: meta.created,
        payload_bytes: payload,
        layout_bytes: layout_len as u32,
    };
    let mut head = encode_header(&header, groups.iter().map(|g| g.len() as u32));
    debug_assert_eq!(head.len(), HEADER_BYTES + layout_len);
    let crc = header_crc(&head);
    head[120..124].copy_from_slice(&crc.to_le_bytes());
    w.seek(SeekFrom::Start(0)).map_err(io("seek"))?;
    w.write_all(&head).map_err(io("write"))?;
    w.seek(SeekFrom::End(0)).map_err(io("seek"))?;
    Ok(header)
}

fn header_crc(head: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&head[..120]);
    h.update(&head[124..]);
    h.finalize()
}

fn encode_header(h: &Header, group_sizes: impl Iterator<Item = u32>) -> Vec<u8> {
    let mut b = Vec::with_capacity(HEADER_BYTES + h.layout_bytes as usize);
    b.extend_from_slice(&MAGIC);
    b.extend_from_slice(&VERSION.to_le_bytes());
    b.push(h.kind.id());
    b.push(h.reason.id());
    b.extend_from_slice(&(h.identity.len() as u32).to_le_bytes());
    b.extend_from_slice(&h.model.0);
    b.extend_from_slice(&h.key.0);
    b.extend_from_slice(&h.parent.0);
    b.extend_from_slice(&h.span_tokens.to_le_bytes());
    b.extend_from_slice(&h.token_start.to_le_bytes());
    b.extend_from_slice(&(h.tokens.len() as u32).to_le_bytes());
    b.extend_from_slice(&h.groups.to_le_bytes());
    b.extend_from_slice(&(h.blocks.len() as u32).to_le_bytes());
    b.extend_from_slice(&h.created.to_le_bytes());
    b.extend_from_slice(&h.payload_bytes.to_le_bytes());
    b.extend_from_slice(&h.layout_bytes.to_le_bytes());
    b.extend_from_slice(&[0u8; 8]); // CRC (filled by the caller) + reserved
    b.extend_from_slice(h.identity.as_bytes());
    for t in &h.tokens {
        b.extend_from_slice(&t.to_le_bytes());
    }
    for n in group_sizes {
        b.extend_from_slice(&n.to_le_bytes());
    }
    for d in &h.blocks {
        b.extend_from_slice(&d.tag.to_le_bytes());
        b.extend_from_slice(&d.rows.to_le_bytes());
        b.extend_from_slice(&d.width.to_le_bytes());
        b.extend_from_slice(&[d.encoding.id(), 0, 0, 0]);
        b.extend_from_slice(&d.bytes.to_le_bytes());
        b.extend_from_slice(&d.crc.to_le_bytes());
        b.extend_from_slice(&[0u8; 4]);
    }
    b
}

/// Little-endian cursor over a byte slice that reports truncation as corruption.
struct Cur<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Cur<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let s = self.b.get(self.pos..self.pos + n).ok_or_else(|| KvError::Corrupt("layout truncated".into()))?;
        self.pos += n;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap_or_default()))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap_or_default()))
    }
    fn key(&mut self) -> Result<Key> {
        Ok(Key(self.take(20)?.try_into().unwrap_or_default()))
    }
}

/// Reads and validates a header + layout from the start of `r` (magic, version, bounds, CRC, block sizes).
pub fn read_header<R: Read>(r: &mut R, path: &Path) -> Result<Header> {
    let corrupt = |m: String| KvError::Corrupt(format!("{}: {m}", path.display()));
    let mut head = vec![0u8; HEADER_BYTES];
    read_exact(r, &mut head, path)?;
    if head[..8] != MAGIC {
        return Err(corrupt("bad magic".into()));
    }
    let mut c = Cur { b: &head, pos: 8 };
    let version = u16::from_le_bytes([head[8], head[9]]);
    if version != VERSION {
        return Err(corrupt(format!("unsupported version {version}")));
    }
    c.pos = 10;
    let kind = match c.take(1)?[0] {
        1 => EntryKind::Page,
        2 => EntryKind::Checkpoint,
        k => return Err(corrupt(format!("unknown kind {k}"))),
    };
    let reason = SaveReason::from_id(c.take(1)?[0]);
    let ident_len = c.u32()?;
    let model = c.key()?;
    let key = c.key()?;
    let parent = c.key()?;
    let span_tokens = c.u32()?;
    let token_start = c.u64()?;
    let n_tokens = c.u32()?;
    let groups = c.u32()?;
    let n_blocks = c.u32()?;
    let created = c.u64()?;
    let payload_bytes = c.u64()?;
    let layout_len = c.u32()?;
    let crc = c.u32()?;
    if ident_len > MAX_IDENTITY || n_tokens > MAX_TOKENS || groups > MAX_GROUPS || n_blocks > MAX_BLOCKS {
        return Err(corrupt("header counts out of range".into()));
    }
    let expect = layout_bytes(ident_len as usize, n_tokens as usize, groups as usize, n_blocks as usize);
    if layout_len as usize != expect {
        return Err(corrupt(format!("layout bytes {layout_len} != {expect}")));
    }
    head.resize(HEADER_BYTES + expect, 0);
    read_exact(r, &mut head[HEADER_BYTES..], path)?;
    if header_crc(&head) != crc {
        return Err(corrupt("header checksum mismatch".into()));
    }
    let mut c = Cur { b: &head, pos: HEADER_BYTES };
    let identity = String::from_utf8(c.take(ident_len as usize)?.to_vec())
        .map_err(|_| corrupt("identity text is not UTF-8".into()))?;
    let tokens = (0..n_tokens).map(|_| c.u32()).collect::<Result<Vec<_>>>()?;
    let sizes = (0..groups).map(|_| c.u32()).collect::<Result<Vec<_>>>()?;
    if sizes.iter().map(|&s| s as u64).sum::<u64>() != n_blocks as u64 {
        return Err(corrupt("group sizes do not add up to the block count".into()));
    }
    let mut blocks = Vec::with_capacity(n_blocks as usize);
    let mut total = 0u64;
    for (gi, &n) in sizes.iter().enumerate() {
        for _ in 0..n {
            let tag = c.u32()?;
            let rows = c.u32()?;
            let width = c.u32()?;
            let e = c.take(4)?[0];
            let encoding = Encoding::from_id(e).ok_or_else(|| corrupt(format!("unknown encoding {e}")))?;
            let bytes = c.u64()?;
            let bcrc = c.u32()?;
            c.take(4)?;
            let n = rows as u64 * width as u64;
            let ok = match encoding {
                Encoding::F32 => bytes == n * 4,
                Encoding::F16 => bytes == n * 2,
                Encoding::Blocked => bytes >= n + n.div_ceil(codec::CHUNK as u64) && bytes <= n * 4 + n,
            };
            if !ok {
                return Err(corrupt(format!("block of {rows}x{width} cannot take {bytes} bytes as {encoding:?}")));
            }
            total = total.saturating_add(bytes);
            blocks.push(BlockDesc { group: gi as u32, tag, rows, width, encoding, bytes, crc: bcrc });
        }
    }
    if total != payload_bytes {
        return Err(corrupt(format!("blocks add up to {total} bytes, header says {payload_bytes}")));
    }
    Ok(Header {
        kind,
        reason,
        identity,
        model,
        key,
        parent,
        span_tokens,
        token_start,
        tokens,
        groups,
        blocks,
        created,
        payload_bytes,
        layout_bytes: layout_len,
    })
}

fn read_exact<R: Read>(r: &mut R, buf: &mut [u8], path: &Path) -> Result<()> {
    r.read_exact(buf).map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            KvError::Corrupt(format!("{}: truncated", path.display()))
        } else {
            KvError::io("read", path, e)
        }
    })
}

/// One decoded block handed to a load callback. Valid only during the call.
#[derive(Debug)]
pub struct RowsView<'a> {
    /// Group (layer) index.
    pub group: u32,
    /// Engine label.
    pub tag: u32,
    /// Row count.
    pub rows: u32,
    /// Values per row.
    pub width: u32,
    /// `rows * width` values.
    pub values: &'a [f32],
}

/// Streams the payload after [`read_header`]: for each block, reads it, checks its CRC, decodes it and calls `f`.
/// Then checks that the input ends there. Holds one encoded and one decoded block at a time.
pub fn stream_blocks<R: Read>(
    r: &mut R,
    path: &Path,
    header: &Header,
    mut f: impl FnMut(RowsView<'_>) -> Result<()>,
) -> Result<()> {
    let mut raw = Vec::new();
    let mut vals = Vec::new();
    for (i, d) in header.blocks.iter().enumerate() {
        raw.resize(d.bytes as usize, 0);
        read_exact(r, &mut raw, path)?;
        if crc32fast::hash(&raw) != d.crc {
            return Err(KvError::Corrupt(format!("{}: block {i} checksum mismatch", path.display())));
        }
        vals.resize(d.rows as usize * d.width as usize, 0f32);
        codec::decode(d.encoding, &raw, &mut vals)
            .map_err(|e| KvError::Corrupt(format!("{}: block {i}: {e}", path.display())))?;
        f(RowsView { group: d.group, tag: d.tag, rows: d.rows, width: d.width, values: &vals })?;
    }
    let mut probe = [0u8; 1];
    match r.read(&mut probe) {
        Ok(0) => Ok(()),
        Ok(_) => Err(KvError::Corrupt(format!("{}: bytes after the payload", path.display()))),
        Err(e) => Err(KvError::io("read", path, e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    fn sample() -> (Vec<f32>, Vec<f32>) {
        let a: Vec<f32> = (0..512 * 3).map(|i| ((i % 17) as f32 - 8.0) * 0.25).collect();
        let b: Vec<f32> = (0..128 * 2).map(|i| (i as f32).sin()).collect();
        (a, b)
    }

    fn write(a: &[f32], b: &[f32]) -> Vec<u8> {
        let groups = vec![
            vec![
                RowBlock { tag: 0, rows: 3, width: 512, values: a },
                RowBlock { tag: 1, rows: 2, width: 128, values: b },
            ],
            vec![],
        ];
        let meta = EntryMeta {
            kind: EntryKind::Page,
            reason: SaveReason::Cold,
            identity: "test-model",
            model: Key([1; 20]),
            key: Key([2; 20]),
            parent: Key([3; 20]),
            span_tokens: 4,
            token_start: 8,
            tokens: &[5, 6, 7, 8],
            created: 42,
        };
        let mut cur = Cursor::new(Vec::new());
        write_entry(&mut cur, Path::new("mem"), &meta, &groups).unwrap();
        cur.into_inner()
    }

    #[test]
    fn write_read_round_trip() {
        let (a, b) = sample();
        let bytes = write(&a, &b);
        let mut r = Cursor::new(&bytes);
        let h = read_header(&mut r, Path::new("mem")).unwrap();
        assert_eq!(h.file_bytes(), bytes.len() as u64);
        assert_eq!((h.kind, h.reason, h.identity.as_str()), (EntryKind::Page, SaveReason::Cold, "test-model"));
        assert_eq!(
            (h.key, h.parent, h.token_start, h.tokens.clone()),
            (Key([2; 20]), Key([3; 20]), 8, vec![5, 6, 7, 8])
        );
        assert_eq!(h.groups, 2);
        let mut got = Vec::new();
        stream_blocks(&mut r, Path::new("mem"), &h, |v| {
            got.push((v.group, v.tag, v.rows, v.width, v.values.to_vec()));
            Ok(())
        })
        .unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].4, a);
        assert_eq!(got[1].4, b);
        assert_eq!((got[1].0, got[1].1, got[1].2, got[1].3), (0, 1, 2, 128));
    }

    #[test]
    fn every_single_bit_flip_and_truncation_is_detected() {
        let a: Vec<f32> = (0..64).map(|i| i as f32).collect();
        let b: Vec<f32> = vec![0.5; 8];
        let groups = vec![vec![
            RowBlock { tag: 0, rows: 1, width: 64, values: &a },
            RowBlock { tag: 1, rows: 1, width: 8, values: &b },
        ]];
        let meta = EntryMeta {
            kind: EntryKind::Checkpoint,
            reason: SaveReason::Evict,
            identity: "m",
            model: Key([1; 20]),
            key: Key([2; 20]),
            parent: Key([3; 20]),
            span_tokens: 4,
            token_start: 4,
            tokens: &[9],
            created: 1,
        };
        let mut cur = Cursor::new(Vec::new());
        write_entry(&mut cur, Path::new("mem"), &meta, &groups).unwrap();
        let good = cur.into_inner();
        let check = |bytes: &[u8]| -> Result<()> {
            let mut r = Cursor::new(bytes);
            let h = read_header(&mut r, Path::new("mem"))?;
            stream_blocks(&mut r, Path::new("mem"), &h, |_| Ok(()))
        };
        check(&good).unwrap();
        for byte in 0..good.len() {
            for bit in 0..8 {
                let mut bad = good.clone();
                bad[byte] ^= 1 << bit;
                assert!(check(&bad).is_err(), "flip at byte {byte} bit {bit} not detected");
            }
        }
        for len in 0..good.len() {
            assert!(matches!(check(&good[..len]), Err(KvError::Corrupt(_))), "truncation to {len}");
        }
        let mut longer = good.clone();
        longer.push(0);
        assert!(check(&longer).is_err());
    }

    #[test]
    fn mismatched_values_are_rejected() {
        let v = vec![0f32; 10];
        let groups = vec![vec![RowBlock { tag: 0, rows: 3, width: 4, values: &v }]];
        assert!(matches!(validate_groups(&groups), Err(KvError::Invalid(_))));
    }

    #[test]
    fn save_reasons_round_trip_through_their_ids() {
        use SaveReason::*;
        for (i, r) in [Unknown, Cold, Continued, Evict, Shutdown, SystemBlock].into_iter().enumerate() {
            assert_eq!(r.id(), i as u8);
            assert_eq!(SaveReason::from_id(i as u8), r);
        }
        assert_eq!(SaveReason::from_id(200), Unknown);
    }
}

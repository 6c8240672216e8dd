//! [`StopChecker`]: stop sequences matched on text (across token boundaries) and a max-token limit.
//!
//! Feed it each token's decoded text (from `tokenizer::StreamDecoder`) with [`StopChecker::push`]. Text that could be
//! the beginning of a stop sequence is held back; what is safe to show is returned in `emit`. On a match, the text
//! before the stop sequence is emitted and the stop sequence itself is not. The caller handles EOS ids itself.

/// Why generation stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// One of the stop sequences (its index in the list) appeared.
    StopSequence(usize),
    /// The token limit was reached.
    MaxTokens,
}

/// The result of one [`StopChecker::push`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopStatus {
    Continue { emit: String },
    Stop { emit: String, reason: StopReason },
}

/// See the module doc.
#[derive(Clone, Debug)]
pub struct StopChecker {
    stops: Vec<String>,
    max_tokens: Option<usize>,
    n_tokens: usize,
    held: String,
    stopped: Option<StopReason>,
}

impl StopChecker {
    /// Empty stop strings are ignored; `max_tokens` `None` = unlimited.
    pub fn new(stops: impl IntoIterator<Item = impl Into<String>>, max_tokens: Option<usize>) -> Self {
        let stops = stops.into_iter().map(Into::into).filter(|s: &String| !s.is_empty()).collect();
        StopChecker { stops, max_tokens, n_tokens: 0, held: String::new(), stopped: None }
    }

    /// Tokens pushed so far.
    pub fn n_tokens(&self) -> usize {
        self.n_tokens
    }

    /// Adds one generated token's text. After a `Stop`, further pushes repeat it with nothing to emit.
    pub fn push(&mut self, piece: &str) -> StopStatus {
        if let Some(reason) = &self.stopped {
            return StopStatus::Stop { emit: String::new(), reason: reason.clone() };
        }
        self.n_tokens += 1;
        self.held.push_str(piece);
        let found = self.stops.iter().enumerate().filter_map(|(i, s)| self.held.find(s.as_str()).map(|p| (p, i))).min();
        if let Some((p, i)) = found {
            self.stopped = Some(StopReason::StopSequence(i));
            let emit = self.held[..p].to_string();
            self.held.clear();
            return StopStatus::Stop { emit, reason: StopReason::StopSequence(i) };
        }
        if self.max_tokens.is_some_and(|m| self.n_tokens >= m) {
            self.stopped = Some(StopReason::MaxTokens);
            return StopStatus::Stop { emit: std::mem::take(&mut self.held), reason: StopReason::MaxTokens };
        }
        let hold = self.partial_len();
        let cut = self.held.len() - hold;
        let emit = self.held[..cut].to_string();
        self.held.drain(..cut);
        StopStatus::Continue { emit }
    }

    /// Text still held back (call at the end of generation, e.g. after EOS).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    fn partial_len(&self) -> usize {
        partial_suffix_len(&self.held, &self.stops)
    }
}

/// Length in bytes of the longest suffix of `buf` that is a proper prefix of one of `markers`: the text a streaming
/// matcher must hold back because the next piece could complete a marker. The one holdback rule shared by
/// [`StopChecker`], the DSML stream parser and the server's stop strings. Always a character boundary of `buf`.
pub fn partial_suffix_len<S: AsRef<str>>(buf: &str, markers: &[S]) -> usize {
    let b = buf.as_bytes();
    let mut best = 0;
    for m in markers {
        let m = m.as_ref().as_bytes();
        let max = m.len().saturating_sub(1).min(b.len());
        for k in (best + 1..=max).rev() {
            if b.ends_with(&m[..k]) {
                best = k;
                break;
            }
        }
    }
    // A suffix that matches a marker prefix starts at a character boundary when the marker does; guard anyway so
    // slicing can never panic.
    while best > 0 && !buf.is_char_boundary(buf.len() - best) {
        best -= 1;
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], max: Option<usize>, pieces: &[&str]) -> (String, Option<StopReason>) {
        let mut c = StopChecker::new(stops.iter().copied(), max);
        let mut out = String::new();
        for p in pieces {
            match c.push(p) {
                StopStatus::Continue { emit } => out += &emit,
                StopStatus::Stop { emit, reason } => return (out + &emit, Some(reason)),
            }
        }
        (out + &c.finish(), None)
    }

    #[test]
    fn stop_across_token_boundaries() {
        assert_eq!(run(&["END"], None, &["abc E", "N", "Dxyz"]), ("abc ".into(), Some(StopReason::StopSequence(0))));
        assert_eq!(run(&["x", "END"], None, &["aE", "ND"]), ("a".into(), Some(StopReason::StopSequence(1))));
        // A partial match that does not complete is released.
        assert_eq!(run(&["END"], None, &["E", "N", "d"]), ("ENd".into(), None));
        // The earliest match wins.
        assert_eq!(run(&["bc", "ab"], None, &["xabc"]), ("x".into(), Some(StopReason::StopSequence(1))));
        assert_eq!(run(&["世界"], None, &["你好世", "界!"]), ("你好".into(), Some(StopReason::StopSequence(0))));
    }

    #[test]
    fn held_text_is_not_emitted_early() {
        let mut c = StopChecker::new(["</stop>"], None);
        assert_eq!(c.push("hi </st"), StopStatus::Continue { emit: "hi ".into() });
        assert_eq!(c.push("art"), StopStatus::Continue { emit: "</start".into() });
    }

    #[test]
    fn partial_suffixes() {
        assert_eq!(partial_suffix_len("abc</thi", &["</think>"]), 5);
        assert_eq!(partial_suffix_len("abc", &["</think>"]), 0);
        assert_eq!(partial_suffix_len("x<", &["<a", "<<b"]), 1);
        assert_eq!(partial_suffix_len("x<<", &["<a", "<<b"]), 2);
        // A whole marker is not a partial one; empty markers hold nothing.
        assert_eq!(partial_suffix_len("ab", &["ab", ""]), 0);
        assert_eq!(partial_suffix_len("", &["ab"]), 0);
        assert_eq!(partial_suffix_len("é", &["é!"]), 2);
    }

    #[test]
    fn max_tokens() {
        assert_eq!(run(&[], Some(2), &["a", "b", "c"]), ("ab".into(), Some(StopReason::MaxTokens)));
        assert_eq!(run(&["zz"], Some(2), &["a", "z"]), ("az".into(), Some(StopReason::MaxTokens)));
        let mut c = StopChecker::new([""], Some(1));
        assert!(matches!(c.push("a"), StopStatus::Stop { .. }));
        assert_eq!(c.push("b"), StopStatus::Stop { emit: String::new(), reason: StopReason::MaxTokens });
        assert_eq!(c.n_tokens(), 1);
    }
}

//! [`StreamDecoder`]: incremental detokenization with stop sequences.

use crate::error::DecodeError;
use crate::tokenizer::Tokenizer;

/// What one [`StreamDecoder::push`] produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamStep<'a> {
    /// Text that is now final: complete UTF-8 that cannot be part of a stop sequence.
    pub text: &'a str,
    /// Set when a stop sequence was found: its index in the list given to
    /// [`StreamDecoder::with_stop_sequences`]. `text` then ends right before it, and the decoder
    /// ignores further tokens.
    pub stopped: Option<usize>,
}

/// Turns token ids, fed one at a time, into text.
///
/// It emits only complete UTF-8 (a token that ends inside a multi-byte character is held until
/// the character completes; bytes that can never form a character become U+FFFD), and finds
/// stop sequences even when they span token boundaries, by holding back any text that could
/// still be the start of one. No allocation per token once its buffers have grown.
///
/// ```
/// use token_stream::{StreamDecoder, Tokenizer};
/// # let mut ranks = String::new();
/// # for b in 0..=255u8 { ranks += &format!("{} {}\n", token_stream::base64_encode(&[b]), b); }
/// # let tok = Tokenizer::from_tiktoken(&ranks, token_stream::Pretokenizer::Cl100k, &[])?;
/// let ids = tok.encode("héllo\nUser: x");
/// let mut dec = StreamDecoder::new(&tok).with_stop_sequences(["\nUser:"]);
/// let mut out = String::new();
/// for &id in ids.iter() {
///     let step = dec.push(id)?;
///     out += step.text;
///     if step.stopped.is_some() { break; }
/// }
/// assert_eq!(out, "héllo");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct StreamDecoder<'t> {
    tok: &'t Tokenizer,
    /// Bytes of an incomplete UTF-8 character.
    pending: Vec<u8>,
    /// Decoded text not yet emitted (a possible stop-sequence prefix).
    held: String,
    /// The text returned by the last call.
    out: String,
    stops: Vec<String>,
    skip_special: bool,
    stopped: Option<usize>,
}

impl<'t> StreamDecoder<'t> {
    /// A decoder without stop sequences that includes special tokens' text.
    pub fn new(tok: &'t Tokenizer) -> Self {
        Self {
            tok,
            pending: Vec::new(),
            held: String::new(),
            out: String::new(),
            stops: Vec::new(),
            skip_special: false,
            stopped: None,
        }
    }

    /// Stops at the first occurrence of any of these strings (empty strings are ignored).
    pub fn with_stop_sequences<I, S>(mut self, stops: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.stops = stops
            .into_iter()
            .map(Into::into)
            .filter(|s: &String| !s.is_empty())
            .collect();
        self
    }

    /// Special tokens produce no text.
    pub fn skip_special_tokens(mut self, skip: bool) -> Self {
        self.skip_special = skip;
        self
    }

    /// The tokenizer it decodes with.
    pub fn tokenizer(&self) -> &'t Tokenizer {
        self.tok
    }

    /// Whether a stop sequence has been found.
    pub fn is_stopped(&self) -> Option<usize> {
        self.stopped
    }

    /// Feeds one token id.
    pub fn push(&mut self, id: u32) -> Result<StreamStep<'_>, DecodeError> {
        self.out.clear();
        if self.stopped.is_some() {
            return Ok(StreamStep {
                text: &self.out,
                stopped: self.stopped,
            });
        }
        let bytes = self.tok.token_bytes(id).ok_or(DecodeError::UnknownId {
            id,
            vocab_size: self.tok.vocab_size(),
        })?;
        if self.skip_special && self.tok.is_special(id) {
            return Ok(StreamStep {
                text: &self.out,
                stopped: None,
            });
        }
        let search_from = self.held.len();
        self.pending.extend_from_slice(bytes);
        drain_utf8(&mut self.pending, &mut self.held, false);
        self.emit(search_from);
        Ok(StreamStep {
            text: &self.out,
            stopped: self.stopped,
        })
    }

    /// Ends the stream: returns all held text (an incomplete trailing character becomes U+FFFD).
    pub fn finish(&mut self) -> &str {
        self.out.clear();
        if self.stopped.is_none() {
            let search_from = self.held.len();
            drain_utf8(&mut self.pending, &mut self.held, true);
            self.emit(search_from);
            self.out.push_str(&self.held);
            self.held.clear();
        }
        &self.out
    }

    /// Moves final text from `held` to `out`, checking for stop sequences in the new text
    /// (which starts at `new_from`; matches may begin up to `max_stop - 1` bytes earlier).
    fn emit(&mut self, new_from: usize) {
        let max_stop = self.stops.iter().map(String::len).max().unwrap_or(0);
        let mut from = new_from.saturating_sub(max_stop.saturating_sub(1));
        while !self.held.is_char_boundary(from) {
            from -= 1;
        }
        let mut first: Option<(usize, usize)> = None;
        for (i, s) in self.stops.iter().enumerate() {
            if let Some(p) = self.held[from..].find(s.as_str()) {
                let p = from + p;
                if first.is_none_or(|(fp, _)| p < fp) {
                    first = Some((p, i));
                }
            }
        }
        if let Some((p, i)) = first {
            self.out.push_str(&self.held[..p]);
            self.held.clear();
            self.pending.clear();
            self.stopped = Some(i);
            return;
        }
        // Keep the longest suffix that is a proper prefix of some stop sequence.
        let mut keep = 0;
        for s in &self.stops {
            let max = (s.len() - 1).min(self.held.len());
            for k in (keep + 1..=max).rev() {
                let start = self.held.len() - k;
                if self.held.is_char_boundary(start)
                    && s.as_bytes().starts_with(&self.held.as_bytes()[start..])
                {
                    keep = k;
                    break;
                }
            }
        }
        let cut = self.held.len() - keep;
        self.out.push_str(&self.held[..cut]);
        self.held.drain(..cut);
    }
}

/// Moves the complete UTF-8 prefix of `pending` into `text`; invalid bytes become U+FFFD. An
/// incomplete character at the end stays in `pending` unless `flush`.
fn drain_utf8(pending: &mut Vec<u8>, text: &mut String, flush: bool) {
    let mut start = 0;
    loop {
        match std::str::from_utf8(&pending[start..]) {
            Ok(s) => {
                text.push_str(s);
                start = pending.len();
                break;
            }
            Err(e) => {
                let good = start + e.valid_up_to();
                text.push_str(
                    std::str::from_utf8(&pending[start..good]).expect("validated prefix"),
                );
                match e.error_len() {
                    Some(n) => {
                        text.push('\u{FFFD}');
                        start = good + n;
                    }
                    None => {
                        if flush {
                            text.push('\u{FFFD}');
                            start = pending.len();
                        } else {
                            start = good;
                        }
                        break;
                    }
                }
            }
        }
    }
    pending.drain(..start);
}

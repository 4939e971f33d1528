//! Keeping request text apart from template text when a render is tokenized.
//!
//! Every string of a chat request (message content, reasoning, roles, tool-call ids, names and
//! arguments, `tool_call_id`, `name`, the tool definitions and documents) is data: its
//! special-token text must stay plain text, whatever the template does with it. Only the
//! template's own markup becomes special ids.
//!
//! Policy: [`scan`] looks at every request string before rendering. When none holds
//! special-token text, the render is tokenized as is (the common, fast path: one render). When
//! one does, the template renders a second time with each string that holds special-token text
//! wrapped in [`OPEN`]..[`CLOSE`]; [`markers_intact`] checks that this render is the plain one
//! with markers inserted, and [`segment`] tokenizes the text between markers as plain text.
//! Strings without special-token text are left unmarked, so templates that compare them
//! (`role == "user"`, a schema's `type == "string"`, Mistral's 9-character call ids) render as
//! they would without marking. JSON object keys cannot be marked (templates look fields up by
//! key), so special-token text in a key is refused.

use minijinja::Value;
use minijinja::value::ValueKind;

use super::{RenderOptions, TemplateMessage};
use crate::error::{ChatError, ChatPart};
use crate::tokenizer::Tokenizer;
use crate::tokens::Tokens;

/// Marks the start of request text inside the rendered template (a Unicode non-character).
pub(super) const OPEN: char = '\u{FDD0}';
/// Marks the end of request text.
pub(super) const CLOSE: char = '\u{FDD1}';

/// Wraps the request strings that hold special-token text of one tokenizer in the markers.
#[derive(Debug, Clone, Copy)]
pub(super) struct Marker<'t> {
    tok: &'t Tokenizer,
}

impl<'t> Marker<'t> {
    pub(super) fn new(tok: &'t Tokenizer) -> Self {
        Self { tok }
    }

    fn has_special(self, s: &str) -> bool {
        self.tok.find_special(s, 0).is_some()
    }
}

/// `s`, wrapped in the markers when a marker is given and `s` holds special-token text.
pub(super) fn text(marker: Option<Marker<'_>>, s: &str) -> String {
    match marker {
        Some(m) if m.has_special(s) => {
            let mut c = String::with_capacity(s.len() + 2 * OPEN.len_utf8());
            c.push(OPEN);
            c.push_str(s);
            c.push(CLOSE);
            c
        }
        _ => s.to_owned(),
    }
}

/// `v` with its string leaves marked as [`text`] marks them; lists and maps are rebuilt in
/// the same order, every other value (and every map key) is kept as it is. Without a marker,
/// `v` itself.
pub(super) fn value(marker: Option<Marker<'_>>, v: Value) -> Value {
    match marker {
        Some(m) => mark_value(m, &v),
        None => v,
    }
}

fn mark_value(m: Marker<'_>, v: &Value) -> Value {
    match v.kind() {
        ValueKind::String => match v.as_str() {
            Some(s) if m.has_special(s) => Value::from(text(Some(m), s)),
            _ => v.clone(),
        },
        ValueKind::Seq => match v.try_iter() {
            Ok(items) => Value::from(items.map(|i| mark_value(m, &i)).collect::<Vec<_>>()),
            Err(_) => v.clone(),
        },
        ValueKind::Map => match v.try_iter() {
            Ok(keys) => Value::from_iter(keys.map(|k| {
                let val = v.get_item(&k).unwrap_or_default();
                (k, mark_value(m, &val))
            })),
            Err(_) => v.clone(),
        },
        _ => v.clone(),
    }
}

/// What [`scan`] has found so far.
struct Scan<'t> {
    tok: &'t Tokenizer,
    /// The first part of the request with special-token text.
    special: Option<ChatPart>,
}

impl Scan<'_> {
    /// Refuses the reserved marker characters; notes special-token text.
    fn string(&mut self, s: &str, at: ChatPart) -> Result<(), ChatError> {
        if s.contains([OPEN, CLOSE]) {
            return Err(ChatError::ReservedChar { at });
        }
        if self.special.is_none() && self.tok.find_special(s, 0).is_some() {
            self.special = Some(at);
        }
        Ok(())
    }

    /// Every string leaf of a JSON-like value; keys may hold neither markers nor special text.
    fn value(&mut self, v: &Value, at: ChatPart) -> Result<(), ChatError> {
        match v.kind() {
            ValueKind::String => self.string(v.as_str().unwrap_or_default(), at),
            ValueKind::Seq => {
                for item in v.try_iter().into_iter().flatten() {
                    self.value(&item, at)?;
                }
                Ok(())
            }
            ValueKind::Map => {
                for k in v.try_iter().into_iter().flatten() {
                    if let Some(key) = k.as_str() {
                        if key.contains([OPEN, CLOSE]) {
                            return Err(ChatError::ReservedChar { at });
                        }
                        if self.tok.find_special(key, 0).is_some() {
                            return Err(ChatError::SpecialTextInKey {
                                at,
                                key: key.to_owned(),
                            });
                        }
                    }
                    self.value(&v.get_item(&k).unwrap_or_default(), at)?;
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// A list's items as parts `part(index)`; anything else as part `part(0)`.
    fn list(&mut self, v: &Value, part: fn(usize) -> ChatPart) -> Result<(), ChatError> {
        if v.kind() == ValueKind::Seq {
            for (index, item) in v.try_iter().into_iter().flatten().enumerate() {
                self.value(&item, part(index))?;
            }
            Ok(())
        } else {
            self.value(v, part(0))
        }
    }
}

/// Checks every request string the template will see: the markers' characters are refused
/// anywhere ([`ChatError::ReservedChar`]), special-token text in a JSON object key is refused
/// ([`ChatError::SpecialTextInKey`]). Returns the first part holding special-token text, if
/// any.
pub(super) fn scan(
    tok: &Tokenizer,
    messages: &[TemplateMessage<'_>],
    opts: &RenderOptions,
) -> Result<Option<ChatPart>, ChatError> {
    let mut scan = Scan { tok, special: None };
    for (index, m) in messages.iter().enumerate() {
        let at = ChatPart::Message { index };
        scan.string(m.role, at)?;
        scan.string(m.content, at)?;
        for s in [m.reasoning_content, m.tool_call_id, m.name]
            .into_iter()
            .flatten()
        {
            scan.string(s, at)?;
        }
        for c in m.tool_calls {
            if let Some(id) = c.id {
                scan.string(id, at)?;
            }
            scan.string(c.name, at)?;
            scan.value(&Value::from_serialize(c.arguments), at)?;
        }
    }
    if let Some(tools) = &opts.tools {
        scan.list(tools, |index| ChatPart::Tool { index })?;
    }
    if let Some(documents) = &opts.documents {
        scan.list(documents, |index| ChatPart::Document { index })?;
    }
    Ok(scan.special)
}

/// Whether `marked` is `plain` with well-nested OPEN..CLOSE pairs inserted.
pub(super) fn markers_intact(marked: &str, plain: &str) -> bool {
    let mut open = false;
    let mut stripped = String::with_capacity(plain.len());
    for c in marked.chars() {
        match c {
            OPEN if !open => open = true,
            CLOSE if open => open = false,
            OPEN | CLOSE => return false,
            c => stripped.push(c),
        }
    }
    !open && stripped == plain
}

/// Tokenizes a render: special-token text outside OPEN..CLOSE becomes special ids, text inside
/// is plain.
pub(super) fn segment(tok: &Tokenizer, rendered: &str) -> Tokens<'static> {
    let mut out = Vec::with_capacity(rendered.len() / 3 + 8);
    // Plain text accumulates across template/request boundaries so pre-tokenization sees the
    // same text as it would in the rendered string.
    let mut plain = String::with_capacity(rendered.len());
    let mut rest = rendered;
    while !rest.is_empty() {
        // Template text up to the next request text.
        let (tmpl, after) = match rest.find(OPEN) {
            Some(p) => (&rest[..p], Some(&rest[p + OPEN.len_utf8()..])),
            None => (rest, None),
        };
        let mut pos = 0;
        while let Some((s, e, id)) = tok.find_special(tmpl, pos) {
            plain.push_str(&tmpl[pos..s]);
            tok.encode_into(&plain, &mut out);
            plain.clear();
            out.push(id);
            pos = e;
        }
        plain.push_str(&tmpl[pos..]);
        match after {
            None => break,
            Some(a) => {
                let end = a.find(CLOSE).unwrap_or(a.len());
                plain.push_str(&a[..end]);
                rest = a.get(end + CLOSE.len_utf8()..).unwrap_or("");
            }
        }
    }
    tok.encode_into(&plain, &mut out);
    Tokens::from(out)
}

//! Chat templates: the model's own Jinja template rendered with minijinja.

use minijinja::{Environment, ErrorKind, context};
use serde::Serialize;

use crate::error::ChatError;
use crate::tokenizer::Tokenizer;
use crate::tokens::Tokens;

/// Marks the start of message text inside the rendered template (a Unicode non-character).
const OPEN: char = '\u{FDD0}';
/// Marks the end of message text.
const CLOSE: char = '\u{FDD1}';

/// One chat message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ChatMessage<'a> {
    /// `system`, `user` or `assistant`.
    pub role: &'a str,
    /// The text.
    pub content: &'a str,
}

impl<'a> ChatMessage<'a> {
    /// A message with this role and content.
    pub fn new(role: &'a str, content: &'a str) -> Self {
        Self { role, content }
    }
}

#[derive(Serialize)]
struct Msg<'a> {
    role: &'a str,
    content: std::borrow::Cow<'a, str>,
}

/// A compiled chat template (HF semantics: `trim_blocks` and `lstrip_blocks` on,
/// `raise_exception` available, `bos_token`/`eos_token` defined).
///
/// [`ChatTemplate::encode`] renders and tokenizes so that the template's own special-token text
/// becomes special ids while message text never does: an `<|im_start|>` typed by a user stays
/// plain text.
///
/// ```
/// use token_stream::{ChatMessage, ChatTemplate};
/// let t = ChatTemplate::new(
///     "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}",
///     "", "",
/// )?;
/// let s = t.render(&[ChatMessage::new("user", "hi")], true)?;
/// assert_eq!(s, "<|user|>hi\n<|assistant|>");
/// # Ok::<(), token_stream::ChatError>(())
/// ```
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// Compiles a Jinja chat template.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, ChatError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_template_owned("chat", source.to_owned())?;
        Ok(Self {
            env,
            bos_token: bos_token.to_owned(),
            eos_token: eos_token.to_owned(),
        })
    }

    /// The template stored with the tokenizer (GGUF `tokenizer.chat_template`), with the
    /// tokenizer's BOS/EOS text.
    pub fn from_tokenizer(tok: &Tokenizer) -> Result<Self, ChatError> {
        let src = tok.chat_template().ok_or(ChatError::NoTemplate)?;
        let text = |id: Option<u32>| {
            id.and_then(|i| tok.token_bytes(i))
                .map(|b| String::from_utf8_lossy(b).into_owned())
                .unwrap_or_default()
        };
        Self::new(src, &text(tok.bos_id()), &text(tok.eos_id()))
    }

    fn render_msgs(
        &self,
        msgs: &[Msg<'_>],
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        let tmpl = self.env.get_template("chat")?;
        Ok(tmpl.render(context! {
            messages => msgs,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
        })?)
    }

    /// Renders the conversation to text, as HF `apply_chat_template(tokenize=False)` does.
    pub fn render(
        &self,
        messages: &[ChatMessage<'_>],
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        let msgs: Vec<Msg<'_>> = messages
            .iter()
            .map(|m| Msg {
                role: m.role,
                content: m.content.into(),
            })
            .collect();
        self.render_msgs(&msgs, add_generation_prompt)
    }

    /// Renders and tokenizes the conversation: special-token text written by the template becomes
    /// special ids, message text is always plain text. For messages without special-token text
    /// the ids equal `tok.encode_with_specials(&self.render(..))`.
    pub fn encode(
        &self,
        tok: &Tokenizer,
        messages: &[ChatMessage<'_>],
        add_generation_prompt: bool,
    ) -> Result<Tokens<'static>, ChatError> {
        let mut msgs = Vec::with_capacity(messages.len());
        for (index, m) in messages.iter().enumerate() {
            if m.content.contains([OPEN, CLOSE]) {
                return Err(ChatError::ReservedChar { index });
            }
            let mut c = String::with_capacity(m.content.len() + 6);
            c.push(OPEN);
            c.push_str(m.content);
            c.push(CLOSE);
            msgs.push(Msg {
                role: m.role,
                content: c.into(),
            });
        }
        let rendered = self.render_msgs(&msgs, add_generation_prompt)?;
        let mut out = Vec::with_capacity(rendered.len() / 3 + 8);
        // Plain text accumulates across template/message boundaries so pre-tokenization sees the
        // same text as it would in the rendered string.
        let mut plain = String::with_capacity(rendered.len());
        let mut rest = rendered.as_str();
        while !rest.is_empty() {
            // Template text up to the next message.
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
        Ok(Tokens::from(out))
    }
}

//! Chat templates: the model's own Jinja template rendered with minijinja the way HF transformers
//! renders it, or one of llama.cpp's built-in templates for models that carry none.

mod builtin;
mod jinja;
mod mark;
mod tools;

use minijinja::Value;

use crate::error::ChatError;
use crate::tokenizer::Tokenizer;
use crate::tokens::Tokens;
use mark::Marker;

pub use builtin::BuiltinTemplate;
pub use tools::{
    ParsedToolCall, TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ToolCallParser, ToolEvent, ToolSyntax,
    forced_call_grammar, polyfill_messages, tool_json, tools_system_prompt,
};

/// One tool call made by an assistant message (OpenAI / transformers shape: the template sees
/// `{"id": .., "type": "function", "function": {"name": .., "arguments": {..}}}`).
///
/// ```
/// use token_stream::ToolCall;
/// let args = serde_json::json!({"city": "Paris"});
/// let call = ToolCall::new("get_weather", &args).with_id("call12345");
/// assert_eq!(call.name, "get_weather");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ToolCall<'a> {
    /// The call's id (`tool_call_id` of the matching `tool` message), when there is one.
    pub id: Option<&'a str>,
    /// The function's name.
    pub name: &'a str,
    /// The arguments, a JSON object as the templates expect (not a string).
    pub arguments: &'a serde_json::Value,
}

impl<'a> ToolCall<'a> {
    /// A call of function `name` with these arguments.
    ///
    /// ```
    /// let args = serde_json::json!({});
    /// let c = token_stream::ToolCall::new("now", &args);
    /// assert!(c.id.is_none());
    /// ```
    pub fn new(name: &'a str, arguments: &'a serde_json::Value) -> Self {
        Self {
            id: None,
            name,
            arguments,
        }
    }

    /// The same call with this id.
    ///
    /// ```
    /// let args = serde_json::json!({});
    /// let c = token_stream::ToolCall::new("now", &args).with_id("call12345");
    /// assert_eq!(c.id, Some("call12345"));
    /// ```
    pub fn with_id(mut self, id: &'a str) -> Self {
        self.id = Some(id);
        self
    }
}

/// One chat message as a chat template sees it: a borrowed view with the role as the
/// template's string (any role a template knows), the text, plus the optional fields
/// tool-using templates read (`tool_calls` on assistant messages, `tool_call_id`/`name` on
/// `tool` messages, `reasoning_content`). Fields left unset are absent from the message the
/// template sees, as transformers drops keys whose value is `None`. A request's turns are
/// `zerolayer_api::ChatMessage`s; a service renders them through this view.
///
/// ```
/// use token_stream::{TemplateMessage, ToolCall};
/// let args = serde_json::json!({"city": "Paris"});
/// let calls = [ToolCall::new("get_weather", &args).with_id("call12345")];
/// let turn = [
///     TemplateMessage::new("user", "Weather in Paris?"),
///     TemplateMessage::new("assistant", "").with_tool_calls(&calls),
///     TemplateMessage::new("tool", "{\"temperature\": 21}").with_tool_call_id("call12345").with_name("get_weather"),
/// ];
/// assert_eq!(turn[1].tool_calls.len(), 1);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct TemplateMessage<'a> {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: &'a str,
    /// The text.
    pub content: &'a str,
    /// Tool calls made by this (assistant) message; empty: no `tool_calls` key.
    pub tool_calls: &'a [ToolCall<'a>],
    /// For a `tool` message: the id of the call this answers.
    pub tool_call_id: Option<&'a str>,
    /// For a `tool` message: the function's name.
    pub name: Option<&'a str>,
    /// The assistant's reasoning; the template sees it as `reasoning_content` and `thinking`, as
    /// transformers passes it.
    pub reasoning_content: Option<&'a str>,
}

impl<'a> TemplateMessage<'a> {
    /// A message with this role and content.
    ///
    /// ```
    /// let m = token_stream::TemplateMessage::new("user", "hi");
    /// assert_eq!((m.role, m.content), ("user", "hi"));
    /// ```
    pub fn new(role: &'a str, content: &'a str) -> Self {
        Self {
            role,
            content,
            tool_calls: &[],
            tool_call_id: None,
            name: None,
            reasoning_content: None,
        }
    }

    /// The same message with these tool calls.
    ///
    /// ```
    /// let a = serde_json::json!({});
    /// let calls = [token_stream::ToolCall::new("f", &a)];
    /// let m = token_stream::TemplateMessage::new("assistant", "").with_tool_calls(&calls);
    /// assert_eq!(m.tool_calls[0].name, "f");
    /// ```
    pub fn with_tool_calls(mut self, calls: &'a [ToolCall<'a>]) -> Self {
        self.tool_calls = calls;
        self
    }

    /// The same message answering the tool call with this id.
    ///
    /// ```
    /// let m = token_stream::TemplateMessage::new("tool", "42").with_tool_call_id("call12345");
    /// assert_eq!(m.tool_call_id, Some("call12345"));
    /// ```
    pub fn with_tool_call_id(mut self, id: &'a str) -> Self {
        self.tool_call_id = Some(id);
        self
    }

    /// The same message with this `name` (the function a `tool` message answers for).
    ///
    /// ```
    /// let m = token_stream::TemplateMessage::new("tool", "42").with_name("f");
    /// assert_eq!(m.name, Some("f"));
    /// ```
    pub fn with_name(mut self, name: &'a str) -> Self {
        self.name = Some(name);
        self
    }

    /// The same message with this reasoning text.
    ///
    /// ```
    /// let m = token_stream::TemplateMessage::new("assistant", "4").with_reasoning("2+2");
    /// assert_eq!(m.reasoning_content, Some("2+2"));
    /// ```
    pub fn with_reasoning(mut self, text: &'a str) -> Self {
        self.reasoning_content = Some(text);
        self
    }
}

/// What a render passes to the template besides the messages, as transformers'
/// `apply_chat_template(messages, tools=.., documents=.., add_generation_prompt=.., **kwargs)`.
///
/// Map key order matters to templates that print JSON (`tools | tojson`): a
/// `serde_json::Value` keeps its keys in the order `serde_json` keeps them (sorted, unless the
/// application enables serde_json's `preserve_order`); [`RenderOptions::tools_json`] and
/// [`RenderOptions::documents_json`] and [`RenderOptions::kwargs_json`] keep the order of the
/// JSON text.
///
/// ```
/// use token_stream::RenderOptions;
/// let opts = RenderOptions::new()
///     .add_generation_prompt(true)
///     .tools_json(r#"[{"type": "function", "function": {"name": "now"}}]"#)?
///     .kwarg("enable_thinking", false);
/// # Ok::<(), token_stream::ChatError>(())
/// ```
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct RenderOptions {
    tools: Option<Value>,
    documents: Option<Value>,
    add_generation_prompt: bool,
    kwargs: Vec<(String, Value)>,
    now: Option<i64>,
}

impl RenderOptions {
    /// No tools, no documents, no generation prompt, no extra keywords, the current time.
    ///
    /// ```
    /// let o = token_stream::RenderOptions::new();
    /// # let _ = o;
    /// ```
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether the template should append the start of an assistant turn.
    ///
    /// ```
    /// let o = token_stream::RenderOptions::new().add_generation_prompt(true);
    /// # let _ = o;
    /// ```
    pub fn add_generation_prompt(mut self, yes: bool) -> Self {
        self.add_generation_prompt = yes;
        self
    }

    /// The tool definitions (a JSON list of function schemas), `tools` in the template.
    ///
    /// ```
    /// let o = token_stream::RenderOptions::new().tools(&serde_json::json!([]));
    /// # let _ = o;
    /// ```
    pub fn tools(mut self, tools: &serde_json::Value) -> Self {
        self.tools = Some(Value::from_serialize(tools));
        self
    }

    /// The tool definitions from JSON text, keeping the text's key order.
    ///
    /// ```
    /// let o = token_stream::RenderOptions::new().tools_json("[]")?;
    /// # Ok::<(), token_stream::ChatError>(())
    /// ```
    pub fn tools_json(mut self, json: &str) -> Result<Self, ChatError> {
        self.tools = Some(parse_json("tools", json)?);
        Ok(self)
    }

    /// The documents (a JSON list of objects, e.g. `title`/`text`), `documents` in the template.
    ///
    /// ```
    /// let o = token_stream::RenderOptions::new().documents(&serde_json::json!([{"title": "a", "text": "b"}]));
    /// # let _ = o;
    /// ```
    pub fn documents(mut self, documents: &serde_json::Value) -> Self {
        self.documents = Some(Value::from_serialize(documents));
        self
    }

    /// The documents from JSON text, keeping the text's key order.
    ///
    /// ```
    /// let o = token_stream::RenderOptions::new().documents_json(r#"[{"title": "a", "text": "b"}]"#)?;
    /// # Ok::<(), token_stream::ChatError>(())
    /// ```
    pub fn documents_json(mut self, json: &str) -> Result<Self, ChatError> {
        self.documents = Some(parse_json("documents", json)?);
        Ok(self)
    }

    /// One extra keyword (`enable_thinking`, `reasoning_effort`, `date_string`, ...).
    /// A later keyword of the same name replaces an earlier one; keywords replace the
    /// built-in variables (`bos_token`, `eos_token`, ...) of the same name.
    ///
    /// ```
    /// let o = token_stream::RenderOptions::new().kwarg("enable_thinking", false);
    /// # let _ = o;
    /// ```
    pub fn kwarg(mut self, name: &str, value: impl serde::Serialize) -> Self {
        self.kwargs.retain(|(k, _)| k != name);
        self.kwargs
            .push((name.to_owned(), Value::from_serialize(&value)));
        self
    }

    /// Extra keywords from a JSON object's text, keeping its key order.
    ///
    /// ```
    /// let o = token_stream::RenderOptions::new().kwargs_json(r#"{"enable_thinking": false}"#)?;
    /// # Ok::<(), token_stream::ChatError>(())
    /// ```
    pub fn kwargs_json(mut self, json: &str) -> Result<Self, ChatError> {
        let v = parse_json("kwargs", json)?;
        let keys = match v.kind() {
            minijinja::value::ValueKind::Map => v.try_iter().ok(),
            _ => None,
        };
        let Some(keys) = keys else {
            return Err(ChatError::InvalidJson {
                what: "kwargs",
                message: "not a JSON object".into(),
            });
        };
        for k in keys {
            let val = v.get_item(&k).unwrap_or_default();
            let name = k.as_str().unwrap_or_default().to_owned();
            self.kwargs.retain(|(n, _)| *n != name);
            self.kwargs.push((name, val));
        }
        Ok(self)
    }

    /// Pins the clock `strftime_now` reads to this Unix time (seconds, UTC); by default it reads
    /// the system clock, in UTC.
    ///
    /// ```
    /// let o = token_stream::RenderOptions::new().now(0);
    /// # let _ = o;
    /// ```
    pub fn now(mut self, unix_seconds: i64) -> Self {
        self.now = Some(unix_seconds);
        self
    }
}

fn parse_json(what: &'static str, json: &str) -> Result<Value, ChatError> {
    serde_json::from_str::<Value>(json).map_err(|e| ChatError::InvalidJson {
        what,
        message: e.to_string(),
    })
}

#[derive(Debug)]
enum Kind {
    Jinja(Box<jinja::Compiled>),
    Builtin(BuiltinTemplate),
}

/// A compiled chat template: a Jinja template rendered as HF transformers renders it
/// (`trim_blocks`, `lstrip_blocks`, loop controls, `raise_exception`, `strftime_now`,
/// transformers' `tojson`, Python string/dict methods), or one of llama.cpp's
/// [`BuiltinTemplate`]s.
///
/// [`ChatTemplate::encode`] renders and tokenizes so that the template's own special-token text
/// becomes special ids while request text (messages, tool calls, tool definitions) never does:
/// an `<|im_start|>` typed by a user or written in a tool's description stays plain text.
///
/// Rendering is bounded: a template gets a fixed amount of minijinja fuel
/// ([`ChatTemplate::FUEL`]) and minijinja's recursion limit, so a hostile template ends in
/// [`ChatError::Exhausted`] instead of hanging.
///
/// ```
/// use token_stream::{TemplateMessage, ChatTemplate};
/// let t = ChatTemplate::new(
///     "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}",
///     "", "",
/// )?;
/// let s = t.render(&[TemplateMessage::new("user", "hi")], true)?;
/// assert_eq!(s, "<|user|>hi\n<|assistant|>");
/// # Ok::<(), token_stream::ChatError>(())
/// ```
#[derive(Debug)]
pub struct ChatTemplate {
    kind: Kind,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// The minijinja fuel one render may spend (roughly one unit per instruction executed).
    pub const FUEL: u64 = 50_000_000;

    /// Compiles a Jinja chat template.
    ///
    /// ```
    /// let e = token_stream::ChatTemplate::new("{% if %}", "", "").unwrap_err();
    /// assert!(matches!(e, token_stream::ChatError::Template(_)));
    /// ```
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, ChatError> {
        Ok(Self {
            kind: Kind::Jinja(Box::new(jinja::Compiled::new(source)?)),
            bos_token: bos_token.to_owned(),
            eos_token: eos_token.to_owned(),
        })
    }

    /// One of llama.cpp's built-in templates (BOS/EOS are not used by them).
    ///
    /// ```
    /// use token_stream::{BuiltinTemplate, TemplateMessage, ChatTemplate};
    /// let t = ChatTemplate::builtin(BuiltinTemplate::Chatml);
    /// let s = t.render(&[TemplateMessage::new("user", "hi")], true)?;
    /// assert_eq!(s, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    /// # Ok::<(), token_stream::ChatError>(())
    /// ```
    pub fn builtin(template: BuiltinTemplate) -> Self {
        Self {
            kind: Kind::Builtin(template),
            bos_token: String::new(),
            eos_token: String::new(),
        }
    }

    /// As llama.cpp's `--chat-template` takes it: a built-in's name (`chatml`, `llama3`, ...)
    /// selects that built-in, anything else is compiled as a Jinja template.
    ///
    /// ```
    /// use token_stream::{BuiltinTemplate, ChatTemplate};
    /// let t = ChatTemplate::from_name_or_source("llama3", "", "")?;
    /// assert_eq!(t.builtin_template(), Some(BuiltinTemplate::Llama3));
    /// # Ok::<(), token_stream::ChatError>(())
    /// ```
    pub fn from_name_or_source(
        name_or_source: &str,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<Self, ChatError> {
        match name_or_source.parse::<BuiltinTemplate>() {
            Ok(b) => Ok(Self::builtin(b)),
            Err(_) => Self::new(name_or_source, bos_token, eos_token),
        }
    }

    /// The template stored with the tokenizer (GGUF `tokenizer.chat_template`), with the
    /// tokenizer's BOS/EOS text, rendered as Jinja. A tokenizer without one gets
    /// [`BuiltinTemplate::Chatml`], which is what llama.cpp falls back to
    /// (`llama_chat_apply_template` with no template, and its server's default).
    /// (llama.cpp's one other fallback, `mistral-v7-tekken` for a Tekken vocabulary in a
    /// 40-layer model, needs the model and is not applied here.)
    ///
    /// ```no_run
    /// # fn f(tok: &token_stream::Tokenizer) -> Result<(), token_stream::ChatError> {
    /// let t = token_stream::ChatTemplate::from_tokenizer(tok)?;
    /// # Ok(()) }
    /// ```
    pub fn from_tokenizer(tok: &Tokenizer) -> Result<Self, ChatError> {
        match tok.chat_template() {
            Some(src) => Self::with_token_ids(src, tok, tok.bos_id(), tok.eos_id()),
            None => Ok(Self::builtin(BuiltinTemplate::Chatml)),
        }
    }

    /// Compiles `source` (Jinja) with `bos_token` / `eos_token` set to the text of the tokens
    /// `bos` / `eos` of `tok` (empty when absent): for a template that comes from elsewhere
    /// than the tokenizer (a Hugging Face `tokenizer_config.json`).
    ///
    /// ```no_run
    /// # fn f(tok: &token_stream::Tokenizer) -> Result<(), token_stream::ChatError> {
    /// let src = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}";
    /// let t = token_stream::ChatTemplate::with_token_ids(src, tok, Some(1), Some(2))?;
    /// # Ok(()) }
    /// ```
    pub fn with_token_ids(
        source: &str,
        tok: &Tokenizer,
        bos: Option<u32>,
        eos: Option<u32>,
    ) -> Result<Self, ChatError> {
        let text = |id: Option<u32>| {
            id.and_then(|i| tok.token_bytes(i))
                .map(|b| String::from_utf8_lossy(b).into_owned())
                .unwrap_or_default()
        };
        Self::new(source, &text(bos), &text(eos))
    }

    /// The built-in this template is, if it is one.
    ///
    /// ```
    /// let t = token_stream::ChatTemplate::builtin(token_stream::BuiltinTemplate::Gemma);
    /// assert_eq!(t.builtin_template(), Some(token_stream::BuiltinTemplate::Gemma));
    /// ```
    pub fn builtin_template(&self) -> Option<BuiltinTemplate> {
        match self.kind {
            Kind::Builtin(b) => Some(b),
            Kind::Jinja(_) => None,
        }
    }

    /// Renders; with a marker, the request strings that hold special-token text are wrapped in
    /// the encode markers (see `mark`).
    fn render_impl(
        &self,
        messages: &[TemplateMessage<'_>],
        opts: &RenderOptions,
        marker: Option<Marker<'_>>,
    ) -> Result<String, ChatError> {
        match &self.kind {
            Kind::Builtin(b) => Ok(b.render_marked(messages, opts.add_generation_prompt, marker)),
            Kind::Jinja(c) => {
                let msgs: Vec<Value> = messages.iter().map(|m| message_value(m, marker)).collect();
                let marked_opts;
                let opts = match marker {
                    None => opts,
                    Some(_) => {
                        marked_opts = RenderOptions {
                            tools: opts.tools.clone().map(|t| mark::value(marker, t)),
                            documents: opts.documents.clone().map(|d| mark::value(marker, d)),
                            ..opts.clone()
                        };
                        &marked_opts
                    }
                };
                c.render(Value::from(msgs), opts, &self.bos_token, &self.eos_token)
            }
        }
    }

    /// Renders the conversation to text, as HF `apply_chat_template(tokenize=False)` does.
    ///
    /// ```
    /// use token_stream::{TemplateMessage, ChatTemplate};
    /// let t = ChatTemplate::new("{{ messages[0].content.strip() }}", "", "")?;
    /// assert_eq!(t.render(&[TemplateMessage::new("user", " hi ")], false)?, "hi");
    /// # Ok::<(), token_stream::ChatError>(())
    /// ```
    pub fn render(
        &self,
        messages: &[TemplateMessage<'_>],
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        self.render_with(
            messages,
            &RenderOptions::new().add_generation_prompt(add_generation_prompt),
        )
    }

    /// Renders with tools, documents and extra keywords, as transformers'
    /// `apply_chat_template(messages, tools=.., documents=.., add_generation_prompt=..,
    /// tokenize=False, **kwargs)`. Built-in templates use only the messages' role and content
    /// and `add_generation_prompt`, as llama.cpp does.
    ///
    /// ```
    /// use token_stream::{TemplateMessage, ChatTemplate, ChatError, RenderOptions};
    /// let t = ChatTemplate::new(
    ///     "{% if tools %}{{ tools | tojson }}{% endif %}{% if not enable_thinking %}{{ raise_exception('no') }}{% endif %}",
    ///     "", "",
    /// )?;
    /// let opts = RenderOptions::new().tools_json(r#"[{"name": "f", "a": 1}]"#)?.kwarg("enable_thinking", true);
    /// assert_eq!(t.render_with(&[], &opts)?, r#"[{"name": "f", "a": 1}]"#);
    /// let e = t.render_with(&[], &RenderOptions::new()).unwrap_err();
    /// assert!(matches!(e, ChatError::Raised { ref message } if message == "no"));
    /// # Ok::<(), token_stream::ChatError>(())
    /// ```
    pub fn render_with(
        &self,
        messages: &[TemplateMessage<'_>],
        opts: &RenderOptions,
    ) -> Result<String, ChatError> {
        self.render_impl(messages, opts, None)
    }

    /// Renders and tokenizes the conversation: special-token text written by the template becomes
    /// special ids, request text is always plain text. For messages without special-token text
    /// the ids equal `tok.encode_with_specials(&self.render(..))`. See
    /// [`ChatTemplate::encode_with`] for the errors.
    ///
    /// ```no_run
    /// # fn f(tok: &token_stream::Tokenizer) -> Result<(), token_stream::ChatError> {
    /// use token_stream::{TemplateMessage, ChatTemplate};
    /// let t = ChatTemplate::from_tokenizer(tok)?;
    /// let ids = t.encode(tok, &[TemplateMessage::new("user", "hi")], true)?;
    /// # Ok(()) }
    /// ```
    pub fn encode(
        &self,
        tok: &Tokenizer,
        messages: &[TemplateMessage<'_>],
        add_generation_prompt: bool,
    ) -> Result<Tokens<'static>, ChatError> {
        self.encode_with(
            tok,
            messages,
            &RenderOptions::new().add_generation_prompt(add_generation_prompt),
        )
    }

    /// [`ChatTemplate::encode`] with tools, documents and extra keywords
    /// (see [`ChatTemplate::render_with`]). Every string of the request is kept apart from
    /// template text: message role, content and reasoning, tool-call ids, names and arguments,
    /// `tool_call_id` and `name`, and the string values of the tools and documents. Only the
    /// template's own text (and the extra keywords, which configure the template) may become
    /// special ids.
    ///
    /// When no request string contains special-token text, the ids are exactly the rendered
    /// text tokenized with special tokens parsed (whatever the template does with the text:
    /// `trim`, `.strip()`, `.split('</think>')`). When one does, the strings that contain it
    /// are marked while rendering so their special-token text stays plain; a template that
    /// cuts, rewrites or tests marked text (so the marked render is not the render) then gives
    /// [`ChatError::SpecialTextTransformed`] rather than risk turning request text into
    /// control tokens. Special-token text in a JSON object key of the tools, documents or
    /// call arguments cannot be marked and gives [`ChatError::SpecialTextInKey`]; the
    /// markers' own characters anywhere give [`ChatError::ReservedChar`].
    ///
    /// ```no_run
    /// # fn f(tok: &token_stream::Tokenizer) -> Result<(), token_stream::ChatError> {
    /// use token_stream::{TemplateMessage, ChatTemplate, RenderOptions};
    /// let t = ChatTemplate::from_tokenizer(tok)?;
    /// let opts = RenderOptions::new().add_generation_prompt(true).kwarg("enable_thinking", false);
    /// let ids = t.encode_with(tok, &[TemplateMessage::new("user", "hi")], &opts)?;
    /// # Ok(()) }
    /// ```
    pub fn encode_with(
        &self,
        tok: &Tokenizer,
        messages: &[TemplateMessage<'_>],
        opts: &RenderOptions,
    ) -> Result<Tokens<'static>, ChatError> {
        let with_special = mark::scan(tok, messages, opts)?;
        let plain = self.render_impl(messages, opts, None)?;
        let Some(at) = with_special else {
            // All special-token text in the render is the template's.
            return Ok(mark::segment(tok, &plain));
        };
        // A template that fails only on marked text reacts to the marking.
        let marked = self
            .render_impl(messages, opts, Some(Marker::new(tok)))
            .map_err(|_| ChatError::SpecialTextTransformed { at })?;
        if !mark::markers_intact(&marked, &plain) {
            return Err(ChatError::SpecialTextTransformed { at });
        }
        Ok(mark::segment(tok, &marked))
    }
}

/// The message as transformers hands it to the template: keys in the order a caller's dict
/// would have them, `None` fields absent, reasoning under `thinking` and `reasoning_content`.
/// With a marker, its strings that hold special-token text are marked.
fn message_value(m: &TemplateMessage<'_>, marker: Option<Marker<'_>>) -> Value {
    let text = |s: &str| Value::from(mark::text(marker, s));
    let mut kv: Vec<(&str, Value)> = Vec::with_capacity(7);
    if let Some(r) = m.reasoning_content {
        kv.push(("thinking", text(r)));
    }
    kv.push(("role", text(m.role)));
    kv.push(("content", text(m.content)));
    if !m.tool_calls.is_empty() {
        let calls: Vec<Value> = m
            .tool_calls
            .iter()
            .map(|c| {
                let mut call: Vec<(&str, Value)> = Vec::with_capacity(3);
                if let Some(id) = c.id {
                    call.push(("id", text(id)));
                }
                call.push(("type", Value::from("function")));
                call.push((
                    "function",
                    Value::from_iter([
                        ("name", text(c.name)),
                        (
                            "arguments",
                            mark::value(marker, Value::from_serialize(c.arguments)),
                        ),
                    ]),
                ));
                Value::from_iter(call)
            })
            .collect();
        kv.push(("tool_calls", Value::from(calls)));
    }
    if let Some(id) = m.tool_call_id {
        kv.push(("tool_call_id", text(id)));
    }
    if let Some(n) = m.name {
        kv.push(("name", text(n)));
    }
    if let Some(r) = m.reasoning_content {
        kv.push(("reasoning_content", text(r)));
    }
    Value::from_iter(kv)
}

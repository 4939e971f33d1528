//! Tool use around a chat template: how tools reach the prompt, how the model's tool calls are
//! found in its output, and the grammar that forces a call.
//!
//! Two call syntaxes are read and written: the Hermes one (`<tool_call>\n{"name": ..,
//! "arguments": {..}}\n</tool_call>`), which Qwen2.5, Qwen3, Hermes 2/3 and Granite 4 templates
//! use, and Llama 3.x's JSON-only reply (`{"name": .., "parameters": {..}}`). A template that
//! renders `tools` in one of them gets the tools as transformers passes them
//! ([`ToolSyntax::Hermes`], [`ToolSyntax::Llama3Json`]). A template without tool support (most small models', SmolLM2's
//! among them) gets them the way llama.cpp's generic tool handling gives them to such models
//! ([`ToolSyntax::HermesPolyfill`]): the tool list and the call format are described in the
//! system message, earlier calls become `<tool_call>` text in the assistant turn and tool
//! results become `<tool_response>` text in a user turn. Either way the output is parsed by
//! [`ToolCallParser`], and a forced call is decoded under [`forced_call_grammar`], so even a
//! small model returns arguments valid for the tool's schema.

use serde_json::{Value, json};

use super::{ChatTemplate, RenderOptions, TemplateMessage};

/// Opens a tool call in the model's output.
pub const TOOL_CALL_OPEN: &str = "<tool_call>";
/// Closes a tool call.
pub const TOOL_CALL_CLOSE: &str = "</tool_call>";

/// How tools reach a template's prompt (the output syntax is Hermes' either way).
///
/// ```
/// use token_stream::{BuiltinTemplate, ChatTemplate, ToolSyntax};
/// let t = ChatTemplate::builtin(BuiltinTemplate::Chatml);
/// assert_eq!(t.tool_syntax(), ToolSyntax::HermesPolyfill);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ToolSyntax {
    /// The template renders `tools`, assistant `tool_calls` and `tool` messages itself, in the
    /// Hermes syntax.
    Hermes,
    /// The template renders them itself and a call is the whole reply, one JSON object
    /// `{"name": .., "parameters": {..}}` (Llama 3.1-3.3's JSON tool calling).
    Llama3Json,
    /// The template has no (Hermes) tool support: [`polyfill_messages`] describes the tools in
    /// the system message and rewrites calls and results as text.
    HermesPolyfill,
}

/// The name of the tool the capability probe renders (unlikely in any real template).
const PROBE_TOOL: &str = "zl_probe_tool_7f3a";
/// The result text the probe's `tool` message carries.
const PROBE_RESULT: &str = "zl_probe_result_7f3a";

impl ChatTemplate {
    /// Whether this template renders tools natively in the Hermes syntax, found by rendering a
    /// probe conversation (a tool definition, a call and its result) and looking for them in
    /// the output, as llama.cpp's template capability checks do.
    ///
    /// ```
    /// use token_stream::{ChatTemplate, ToolSyntax};
    /// let src = "{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}\
    ///     {% for m in messages %}{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n\
    ///     {{ c.function | tojson }}\n</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}{% endfor %}";
    /// assert_eq!(ChatTemplate::new(src, "", "")?.tool_syntax(), ToolSyntax::Hermes);
    /// # Ok::<(), token_stream::ChatError>(())
    /// ```
    pub fn tool_syntax(&self) -> ToolSyntax {
        if self.builtin_template().is_some() {
            return ToolSyntax::HermesPolyfill;
        }
        // A full schema: some templates walk `parameters.properties` and their descriptions.
        let schema = json!({
            "type": "object",
            "properties": {"x": {"type": "integer", "description": "A number."}},
            "required": ["x"],
        });
        let tools = json!([tool_json(PROBE_TOOL, Some("A probe."), &schema)]);
        let args = json!({"x": 1});
        let calls = [super::ToolCall::new(PROBE_TOOL, &args).with_id("call_probe")];
        let messages = [
            TemplateMessage::new("user", "probe"),
            TemplateMessage::new("assistant", "").with_tool_calls(&calls),
            TemplateMessage::new("tool", PROBE_RESULT)
                .with_tool_call_id("call_probe")
                .with_name(PROBE_TOOL),
        ];
        let opts = RenderOptions::new()
            .add_generation_prompt(true)
            .tools(&tools);
        match self.render_with(&messages, &opts) {
            Ok(s) if s.contains(PROBE_RESULT) && s.matches(PROBE_TOOL).count() >= 2 => {
                if renders_hermes_call(&s) {
                    ToolSyntax::Hermes
                } else if renders_json_call(&s) {
                    ToolSyntax::Llama3Json
                } else {
                    ToolSyntax::HermesPolyfill
                }
            }
            _ => ToolSyntax::HermesPolyfill,
        }
    }
}

/// Whether the probe's call is the probe call as a bare JSON object (`{"name": .., "parameters":
/// ..}`), as Llama 3.x templates write an assistant's call.
fn renders_json_call(render: &str) -> bool {
    render.match_indices("{\"name\"").any(|(at, _)| {
        let mut values = serde_json::Deserializer::from_str(&render[at..]).into_iter::<Value>();
        matches!(values.next(), Some(Ok(v)) if v.get("parameters").is_some()
            && call_of(&v).is_some_and(|c| c.name == PROBE_TOOL && c.arguments == json!({"x": 1})))
    })
}

/// Whether a render holds the probe's call as a Hermes block: `<tool_call>`, then a JSON
/// object with the probe tool's name and arguments (other syntaxes that open with the same
/// tag, as GLM's or Qwen3-Coder's XML-like ones, do not count).
fn renders_hermes_call(render: &str) -> bool {
    render.match_indices(TOOL_CALL_OPEN).any(|(at, _)| {
        let body = &render[at + TOOL_CALL_OPEN.len()..];
        let body = body.find(TOOL_CALL_CLOSE).map_or(body, |end| &body[..end]);
        parse_call(body).is_some_and(|c| c.name == PROBE_TOOL && c.arguments == json!({"x": 1}))
    })
}

/// One tool definition in the shape templates and the polyfill prompt show it (OpenAI's:
/// `{"type": "function", "function": {"name", "description", "parameters"}}`).
///
/// ```
/// let t = token_stream::tool_json("now", Some("The time"), &serde_json::json!({"type": "object"}));
/// assert_eq!(t["function"]["name"], "now");
/// ```
pub fn tool_json(name: &str, description: Option<&str>, parameters: &Value) -> Value {
    let mut f = serde_json::Map::new();
    f.insert("name".into(), Value::from(name));
    if let Some(d) = description {
        f.insert("description".into(), Value::from(d));
    }
    f.insert("parameters".into(), parameters.clone());
    json!({"type": "function", "function": Value::Object(f)})
}

/// The system-message text that describes `tools` (a list of [`tool_json`] values) and the call
/// format to a model whose template has no tool support (the wording of Qwen2.5's template).
///
/// ```
/// let tools = serde_json::json!([token_stream::tool_json("now", None, &serde_json::json!({}))]);
/// let p = token_stream::tools_system_prompt(&tools);
/// assert!(p.contains("<tools>\n{\"type\":\"function\""));
/// ```
pub fn tools_system_prompt(tools: &Value) -> String {
    let mut s = String::from(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
         You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
    );
    for t in tools.as_array().into_iter().flatten() {
        s.push('\n');
        s.push_str(&t.to_string());
    }
    s.push_str(
        "\n</tools>\n\nFor each function call, return a json object with function name and \
         arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n\
         {\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
    );
    s
}

/// A call as the model writes it (and as [`polyfill_messages`] writes earlier ones).
fn call_text(name: &str, arguments: &Value) -> String {
    format!(
        "{TOOL_CALL_OPEN}\n{}\n{TOOL_CALL_CLOSE}",
        json!({"name": name, "arguments": arguments})
    )
}

/// The conversation rewritten for a template without tool support
/// ([`ToolSyntax::HermesPolyfill`]): the tools (a list of [`tool_json`] values; none when
/// empty) described in the system message (added first when there is none), each assistant's calls appended to its text as `<tool_call>` blocks,
/// and each run of `tool` messages joined into one user message of `<tool_response>` blocks.
/// Returns `(role, content)` pairs (roles `system`, `user`, `assistant`).
///
/// ```
/// use token_stream::{TemplateMessage, ToolCall, polyfill_messages};
/// let args = serde_json::json!({"city": "Paris"});
/// let calls = [ToolCall::new("weather", &args)];
/// let msgs = [
///     TemplateMessage::new("user", "Weather?"),
///     TemplateMessage::new("assistant", "").with_tool_calls(&calls),
///     TemplateMessage::new("tool", "21 C").with_name("weather"),
/// ];
/// let tools = serde_json::json!([token_stream::tool_json("weather", None, &serde_json::json!({}))]);
/// let out = polyfill_messages(&msgs, &tools);
/// assert_eq!(out[0].0, "system");
/// assert_eq!(out[2].1, "<tool_call>\n{\"name\":\"weather\",\"arguments\":{\"city\":\"Paris\"}}\n</tool_call>");
/// assert_eq!(out[3], ("user", "<tool_response>\n21 C\n</tool_response>".to_string()));
/// ```
pub fn polyfill_messages(
    messages: &[TemplateMessage<'_>],
    tools: &Value,
) -> Vec<(&'static str, String)> {
    let mut out: Vec<(&'static str, String)> = Vec::with_capacity(messages.len() + 1);
    let rest = if tools.as_array().is_none_or(Vec::is_empty) {
        messages
    } else {
        let prompt = tools_system_prompt(tools);
        match messages.first() {
            Some(m) if m.role == "system" => {
                out.push(("system", format!("{}\n\n{prompt}", m.content)));
                &messages[1..]
            }
            _ => {
                out.push(("system", prompt));
                messages
            }
        }
    };
    let mut in_tool_run = false;
    for m in rest {
        match m.role {
            "tool" => {
                let block = format!("<tool_response>\n{}\n</tool_response>", m.content);
                match out.last_mut() {
                    Some(last) if in_tool_run => {
                        last.1.push('\n');
                        last.1.push_str(&block);
                    }
                    _ => out.push(("user", block)),
                }
                in_tool_run = true;
                continue;
            }
            "assistant" => {
                let mut text = m.content.to_owned();
                for c in m.tool_calls {
                    if !text.is_empty() {
                        text.push('\n');
                    }
                    text.push_str(&call_text(c.name, c.arguments));
                }
                out.push(("assistant", text));
            }
            "system" => out.push(("system", m.content.to_owned())),
            _ => out.push(("user", m.content.to_owned())),
        }
        in_tool_run = false;
    }
    out
}

/// The Lark grammar (llguidance's dialect) of exactly one tool call of one of `tools`
/// (`(name, parameters schema)` pairs) in `syntax`: `<tool_call>\n{"name": <one of the names>,
/// "arguments": <valid for that tool's schema>}\n</tool_call>` (Hermes), or the bare object
/// with `parameters` (Llama 3.x), in compact JSON.
///
/// ```
/// use token_stream::{ToolSyntax, forced_call_grammar};
/// let schema = serde_json::json!({"type": "object", "properties": {"city": {"type": "string"}}});
/// let g = forced_call_grammar(ToolSyntax::Hermes, &[("weather", &schema)]);
/// assert!(g.starts_with("start: \"<tool_call>\\n\" call \"\\n</tool_call>\""));
/// assert!(g.contains("\"const\":\"weather\""));
/// let g = forced_call_grammar(ToolSyntax::Llama3Json, &[("weather", &schema)]);
/// assert!(g.starts_with("start: call\n") && g.contains("\"parameters\""));
/// ```
pub fn forced_call_grammar(syntax: ToolSyntax, tools: &[(&str, &Value)]) -> String {
    let args = match syntax {
        ToolSyntax::Llama3Json => "parameters",
        _ => "arguments",
    };
    let one = |name: &str, params: &Value| {
        json!({
            "type": "object",
            "properties": {"name": {"const": name}, args: params},
            "required": ["name", args],
            "additionalProperties": false,
        })
    };
    let mut schema = match tools {
        [(name, params)] => one(name, params),
        many => json!({"anyOf": many.iter().map(|(n, p)| one(n, p)).collect::<Vec<_>>()}),
    };
    if let Some(o) = schema.as_object_mut() {
        // Compact JSON: a small model could otherwise spend its budget on free whitespace.
        o.insert("x-guidance".into(), json!({"whitespace_flexible": false}));
    }
    match syntax {
        ToolSyntax::Llama3Json => format!("start: call\ncall: %json {schema}\n"),
        _ => format!("start: \"<tool_call>\\n\" call \"\\n</tool_call>\"\ncall: %json {schema}\n"),
    }
}

/// A tool call found in the model's output.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct ParsedToolCall {
    /// The function's name.
    pub name: String,
    /// The arguments (a JSON object when the model wrote one).
    pub arguments: Value,
}

/// What [`ToolCallParser`] finds in the output.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum ToolEvent {
    /// Text that is not part of a call (whitespace between and after calls is dropped).
    Text(String),
    /// A complete call.
    Call(ParsedToolCall),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Outside a call.
    Text,
    /// Inside `<tool_call>` .. `</tool_call>`.
    Call,
    /// Llama 3.x: before the reply's first non-blank character, which decides.
    Undecided,
    /// Llama 3.x: the reply opened with `{`: it is held whole, a call if it parses as one.
    Json,
    /// Llama 3.x: the reply opened with something else: all of it is text.
    Plain,
}

/// Finds tool calls in streamed output text, as it arrives. Hermes ([`ToolCallParser::new`]):
/// text passes through at once except for a tail that could be the start of `<tool_call>`; a
/// call is reported when its closing tag arrives (or at the end, when the output stops right
/// after the call's JSON); a block whose content is not a `{"name", "arguments"}` object is
/// passed on as text. Llama 3.x ([`ToolCallParser::for_syntax`]): a reply that opens with `{`
/// is held to the end and is a call when it parses as `{"name", "parameters"}` (several
/// separated by `;` are several calls), else it is text; any other reply streams as text.
///
/// ```
/// use token_stream::{ToolCallParser, ToolEvent};
/// let mut p = ToolCallParser::new();
/// let mut out = Vec::new();
/// for piece in ["Let me check.<tool", "_call>\n{\"name\": \"now\", \"argu", "ments\": {}}\n</tool_call>"] {
///     p.push(piece, &mut out);
/// }
/// p.finish(&mut out);
/// assert_eq!(out[0], ToolEvent::Text("Let me check.".into()));
/// assert!(matches!(&out[1], ToolEvent::Call(c) if c.name == "now"));
/// ```
#[derive(Debug, Clone)]
pub struct ToolCallParser {
    state: State,
    /// Text held back: a possible tag start, a call's body, or whitespace after a call.
    held: String,
    /// Calls found so far.
    calls: usize,
}

impl Default for ToolCallParser {
    fn default() -> Self {
        Self::new()
    }
}

/// The longest suffix of `s` that is a proper prefix of `tag` (where a tag split across pieces
/// may start).
fn partial_tag_start(s: &str, tag: &str) -> usize {
    (1..tag.len().min(s.len() + 1))
        .rev()
        .find(|&n| s.is_char_boundary(s.len() - n) && tag.starts_with(&s[s.len() - n..]))
        .unwrap_or(0)
}

/// A call's body as `{"name": .., "arguments": ..}` (`parameters` accepted for `arguments`, and
/// arguments given as a JSON string decoded).
fn parse_call(body: &str) -> Option<ParsedToolCall> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    call_of(&v)
}

/// A call from its JSON object.
fn call_of(v: &Value) -> Option<ParsedToolCall> {
    let o = v.as_object()?;
    let name = o.get("name")?.as_str()?.to_owned();
    let arguments = match o.get("arguments").or_else(|| o.get("parameters")) {
        None | Some(Value::Null) => json!({}),
        Some(Value::String(s)) => serde_json::from_str(s).unwrap_or(Value::String(s.clone())),
        Some(a) => a.clone(),
    };
    Some(ParsedToolCall { name, arguments })
}

impl ToolCallParser {
    /// A parser at the start of the output.
    ///
    /// ```
    /// assert_eq!(token_stream::ToolCallParser::new().calls(), 0);
    /// ```
    pub fn new() -> Self {
        Self {
            state: State::Text,
            held: String::new(),
            calls: 0,
        }
    }

    /// A parser for the calls of `syntax` (Hermes for the polyfill).
    ///
    /// ```
    /// use token_stream::{ToolCallParser, ToolEvent, ToolSyntax};
    /// let mut p = ToolCallParser::for_syntax(ToolSyntax::Llama3Json);
    /// let mut out = Vec::new();
    /// p.push(" {\"name\": \"now\", \"param", &mut out);
    /// p.push("eters\": {}}", &mut out);
    /// assert!(out.is_empty());
    /// p.finish(&mut out);
    /// assert!(matches!(&out[0], ToolEvent::Call(c) if c.name == "now"));
    /// ```
    pub fn for_syntax(syntax: ToolSyntax) -> Self {
        let mut p = Self::new();
        if syntax == ToolSyntax::Llama3Json {
            p.state = State::Undecided;
        }
        p
    }

    /// How many calls were found so far.
    ///
    /// ```
    /// let mut p = token_stream::ToolCallParser::new();
    /// let mut out = Vec::new();
    /// p.push("<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>", &mut out);
    /// assert_eq!(p.calls(), 1);
    /// ```
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// Takes the next piece of output, appending what it completes to `out`.
    ///
    /// ```
    /// let mut p = token_stream::ToolCallParser::new();
    /// let mut out = Vec::new();
    /// p.push("plain text", &mut out);
    /// assert_eq!(out, [token_stream::ToolEvent::Text("plain text".into())]);
    /// ```
    pub fn push(&mut self, piece: &str, out: &mut Vec<ToolEvent>) {
        // A call's body grows token by token: only its new end can hold the closing tag.
        let mut from = self.held.len().saturating_sub(TOOL_CALL_CLOSE.len() - 1);
        self.held.push_str(piece);
        loop {
            match self.state {
                State::Undecided => match self.held.trim_start().chars().next() {
                    None => return,
                    Some('{') => self.state = State::Json,
                    Some(_) => self.state = State::Plain,
                },
                State::Json => return,
                State::Plain => {
                    self.emit_text(out);
                    return;
                }
                State::Text => match self.held.find(TOOL_CALL_OPEN) {
                    Some(at) => {
                        let rest = self.held.split_off(at + TOOL_CALL_OPEN.len());
                        self.held.truncate(at);
                        if self.calls > 0 && self.held.trim().is_empty() {
                            // Whitespace between two calls.
                            self.held.clear();
                        }
                        self.emit_text(out);
                        self.held = rest;
                        self.state = State::Call;
                        from = 0;
                    }
                    None => {
                        let keep = partial_tag_start(&self.held, TOOL_CALL_OPEN);
                        let tail = self.held.split_off(self.held.len() - keep);
                        // After a call, whitespace waits: it is only passed on when text follows.
                        if self.calls == 0 || !self.held.trim().is_empty() {
                            self.emit_text(out);
                        }
                        self.held.push_str(&tail);
                        return;
                    }
                },
                State::Call => {
                    while !self.held.is_char_boundary(from) {
                        from -= 1;
                    }
                    match self.held[from..].find(TOOL_CALL_CLOSE).map(|at| from + at) {
                        Some(at) => {
                            let rest = self.held.split_off(at + TOOL_CALL_CLOSE.len());
                            self.held.truncate(at);
                            self.end_call(out, true);
                            self.held = rest;
                            self.state = State::Text;
                        }
                        None => return,
                    }
                }
            }
        }
    }

    /// Ends the output: held text is passed on, and a call left open is reported when its
    /// body is a complete call (else passed on as text).
    ///
    /// ```
    /// let mut p = token_stream::ToolCallParser::new();
    /// let mut out = Vec::new();
    /// p.push("<tool_call>\n{\"name\": \"f\", \"arguments\": {}}", &mut out);
    /// assert!(out.is_empty());
    /// p.finish(&mut out);
    /// assert_eq!(p.calls(), 1);
    /// ```
    pub fn finish(&mut self, out: &mut Vec<ToolEvent>) {
        match self.state {
            State::Call => self.end_call(out, false),
            State::Json => {
                let calls: Option<Vec<ParsedToolCall>> =
                    self.held.split(';').map(parse_call).collect();
                match calls {
                    Some(calls) if !calls.is_empty() => {
                        self.held.clear();
                        self.calls += calls.len();
                        out.extend(calls.into_iter().map(ToolEvent::Call));
                    }
                    _ => self.emit_text(out),
                }
            }
            State::Undecided | State::Plain => self.emit_text(out),
            State::Text if self.calls > 0 && self.held.trim().is_empty() => self.held.clear(),
            State::Text => self.emit_text(out),
        }
        self.state = State::Text;
    }

    fn emit_text(&mut self, out: &mut Vec<ToolEvent>) {
        if self.held.is_empty() {
            return;
        }
        let text = std::mem::take(&mut self.held);
        match out.last_mut() {
            Some(ToolEvent::Text(t)) => t.push_str(&text),
            _ => out.push(ToolEvent::Text(text)),
        }
    }

    /// The held body ends a call (`closed`: by its tag).
    fn end_call(&mut self, out: &mut Vec<ToolEvent>, closed: bool) {
        let body = std::mem::take(&mut self.held);
        match parse_call(&body) {
            Some(call) => {
                self.calls += 1;
                out.push(ToolEvent::Call(call));
            }
            None => {
                let close = if closed { TOOL_CALL_CLOSE } else { "" };
                self.held = format!("{TOOL_CALL_OPEN}{body}{close}");
                self.emit_text(out);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_all(pieces: &[&str]) -> Vec<ToolEvent> {
        let mut p = ToolCallParser::new();
        let mut out = Vec::new();
        for s in pieces {
            p.push(s, &mut out);
        }
        p.finish(&mut out);
        out
    }

    fn call(name: &str, arguments: Value) -> ToolEvent {
        ToolEvent::Call(ParsedToolCall {
            name: name.into(),
            arguments,
        })
    }

    #[test]
    fn text_calls_and_whitespace_between_them() {
        let out = parse_all(&[
            "I will look.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": 1}}\n</tool_call>\n",
            "<tool_call>\n{\"name\": \"b\", \"arguments\": \"{\\\"y\\\": 2}\"}\n</tool_call>\n\n",
        ]);
        assert_eq!(
            out,
            [
                ToolEvent::Text("I will look.\n".into()),
                call("a", json!({"x": 1})),
                call("b", json!({"y": 2})),
            ]
        );
    }

    #[test]
    fn every_split_of_the_output_gives_the_same_events() {
        let s = "Hi <tool_c <tool_call>{\"name\": \"f\", \"parameters\": {\"q\": \"é\"}}</tool_call> done";
        let whole = parse_all(&[s]);
        assert_eq!(
            whole,
            [
                ToolEvent::Text("Hi <tool_c ".into()),
                call("f", json!({"q": "é"})),
                ToolEvent::Text(" done".into()),
            ]
        );
        for (i, _) in s.char_indices() {
            for (j, _) in s.char_indices().filter(|&(j, _)| j >= i) {
                assert_eq!(parse_all(&[&s[..i], &s[i..j], &s[j..]]), whole, "{i} {j}");
            }
        }
    }

    fn parse_llama(pieces: &[&str]) -> Vec<ToolEvent> {
        let mut p = ToolCallParser::for_syntax(ToolSyntax::Llama3Json);
        let mut out = Vec::new();
        for s in pieces {
            p.push(s, &mut out);
        }
        p.finish(&mut out);
        out
    }

    #[test]
    fn llama_replies_are_calls_when_they_are_json_calls() {
        assert_eq!(
            parse_llama(&["\n", "{\"name\": \"f\", ", "\"parameters\": {\"a\": 1}}"]),
            [call("f", json!({"a": 1}))]
        );
        assert_eq!(
            parse_llama(&[
                "{\"name\": \"f\", \"parameters\": {}}; {\"name\": \"g\", \"parameters\": {}}"
            ]),
            [call("f", json!({})), call("g", json!({}))]
        );
        assert_eq!(
            parse_llama(&["{not json"]),
            [ToolEvent::Text("{not json".into())]
        );
        let mut p = ToolCallParser::for_syntax(ToolSyntax::Llama3Json);
        let mut out = Vec::new();
        p.push("It is ", &mut out);
        p.push("sunny {\"name\"", &mut out);
        assert_eq!(out, [ToolEvent::Text("It is sunny {\"name\"".into())]);
        p.finish(&mut out);
        assert_eq!(p.calls(), 0);
        assert_eq!(parse_llama(&["  "]), [ToolEvent::Text("  ".into())]);
    }

    #[test]
    fn malformed_and_unclosed_blocks() {
        assert_eq!(
            parse_all(&["<tool_call>not json</tool_call>"]),
            [ToolEvent::Text("<tool_call>not json</tool_call>".into())]
        );
        assert_eq!(
            parse_all(&["<tool_call>{\"name\": \"f\"}"]),
            [call("f", json!({}))]
        );
        assert_eq!(
            parse_all(&["<tool_call>{\"name\": \"f\", \"argu"]),
            [ToolEvent::Text(
                "<tool_call>{\"name\": \"f\", \"argu".into()
            )]
        );
        assert_eq!(parse_all(&["<tool_"]), [ToolEvent::Text("<tool_".into())]);
    }

    #[test]
    fn forced_grammar_lists_every_tool() {
        let a = json!({"type": "object"});
        let b = json!({"type": "object", "properties": {"n": {"type": "integer"}}});
        let g = forced_call_grammar(ToolSyntax::Hermes, &[("a", &a), ("b", &b)]);
        let schema: Value = serde_json::from_str(
            g.lines()
                .nth(1)
                .unwrap()
                .strip_prefix("call: %json ")
                .unwrap(),
        )
        .unwrap();
        let names: Vec<&str> = schema["anyOf"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["properties"]["name"]["const"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(schema["anyOf"][1]["properties"]["arguments"], b);
    }

    #[test]
    fn polyfill_keeps_the_system_prompt_and_groups_tool_results() {
        let args = json!({});
        let calls = [super::super::ToolCall::new("f", &args)];
        let msgs = [
            TemplateMessage::new("system", "Be brief."),
            TemplateMessage::new("user", "go"),
            TemplateMessage::new("assistant", "Calling.").with_tool_calls(&calls),
            TemplateMessage::new("tool", "1"),
            TemplateMessage::new("tool", "2"),
            TemplateMessage::new("user", "thanks"),
        ];
        let out = polyfill_messages(&msgs, &json!([tool_json("f", None, &json!({}))]));
        let roles: Vec<&str> = out.iter().map(|m| m.0).collect();
        assert_eq!(roles, ["system", "user", "assistant", "user", "user"]);
        assert!(out[0].1.starts_with("Be brief.\n\n# Tools"));
        assert!(
            out[0]
                .1
                .contains("{\"type\":\"function\",\"function\":{\"name\":\"f\"")
        );
        assert_eq!(
            out[2].1,
            "Calling.\n<tool_call>\n{\"name\":\"f\",\"arguments\":{}}\n</tool_call>"
        );
        assert_eq!(
            out[3].1,
            "<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response>"
        );
    }

    #[test]
    fn a_template_without_tools_is_polyfilled_and_a_hermes_one_is_native() {
        let plain = ChatTemplate::new(
            "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
            "",
            "",
        )
        .unwrap();
        assert_eq!(plain.tool_syntax(), ToolSyntax::HermesPolyfill);
        // Renders tools but not calls or results: not enough.
        let half = ChatTemplate::new(
            "{{ tools | tojson }}<tool_call>{% for m in messages %}{{ m.content }}{% endfor %}",
            "",
            "",
        )
        .unwrap();
        assert_eq!(half.tool_syntax(), ToolSyntax::HermesPolyfill);
    }
}

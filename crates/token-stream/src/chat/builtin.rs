//! llama.cpp's built-in chat templates (`src/llama-chat.cpp` of llama.cpp as vendored by
//! llama-cpp-python 0.3.36): names, detection from a template's source, and rendering.

use std::fmt::Write as _;

use super::TemplateMessage;
use super::mark::{self, Marker};
use crate::error::ChatError;

macro_rules! builtins {
    ($( $(#[$doc:meta])* $v:ident = $name:literal ),* $(,)?) => {
        /// One of llama.cpp's built-in chat templates (its `LLM_CHAT_TEMPLATES`, named as
        /// llama.cpp names them), rendered byte for byte as llama.cpp's
        /// `llm_chat_apply_template` renders it: role and content of each message only.
        ///
        /// ```
        /// use token_stream::BuiltinTemplate;
        /// let t: BuiltinTemplate = "llama3".parse()?;
        /// assert_eq!(t, BuiltinTemplate::Llama3);
        /// assert_eq!(t.name(), "llama3");
        /// assert_eq!(BuiltinTemplate::detect("{{ '<|start_header_id|>' }}{{ '<|end_header_id|>' }}"), Some(t));
        /// # Ok::<(), token_stream::ChatError>(())
        /// ```
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum BuiltinTemplate {
            $( $(#[$doc])* $v, )*
            /// `dots1` (dots.llm1): llama.cpp detects it from a template's text but has no name
            /// for it, so `"dots1".parse()` fails as it does in llama.cpp.
            Dots1,
        }

        impl BuiltinTemplate {
            /// Every built-in llama.cpp can select by name, in its (alphabetical) order.
            pub const ALL: &'static [BuiltinTemplate] = &[$(BuiltinTemplate::$v),*];

            /// The name llama.cpp gives this template.
            ///
            /// ```
            /// assert_eq!(token_stream::BuiltinTemplate::MistralV7Tekken.name(), "mistral-v7-tekken");
            /// ```
            pub fn name(self) -> &'static str {
                match self {
                    $(Self::$v => $name,)*
                    Self::Dots1 => "dots1",
                }
            }
        }

        impl std::str::FromStr for BuiltinTemplate {
            type Err = ChatError;

            fn from_str(s: &str) -> Result<Self, ChatError> {
                match s {
                    $($name => Ok(Self::$v),)*
                    _ => Err(ChatError::UnknownBuiltin { name: s.to_owned() }),
                }
            }
        }
    };
}

builtins! {
    /// `bailing` (Ling/Ring).
    Bailing = "bailing",
    /// `bailing-think`.
    BailingThink = "bailing-think",
    /// `bailing2` (Ling 2.0).
    Bailing2 = "bailing2",
    /// `chatglm3`.
    Chatglm3 = "chatglm3",
    /// `chatglm4`.
    Chatglm4 = "chatglm4",
    /// `chatml`: `<|im_start|>role\ncontent<|im_end|>\n`; llama.cpp's default.
    Chatml = "chatml",
    /// `command-r` (Cohere Command R).
    CommandR = "command-r",
    /// `deepseek` (deepseek-coder instruct).
    Deepseek = "deepseek",
    /// `deepseek-ocr`: contents concatenated.
    DeepseekOcr = "deepseek-ocr",
    /// `deepseek2` (DeepSeek-V2).
    Deepseek2 = "deepseek2",
    /// `deepseek3` (DeepSeek-V3).
    Deepseek3 = "deepseek3",
    /// `exaone-moe`.
    ExaoneMoe = "exaone-moe",
    /// `exaone3`.
    Exaone3 = "exaone3",
    /// `exaone4`.
    Exaone4 = "exaone4",
    /// `falcon3`.
    Falcon3 = "falcon3",
    /// `gemma`.
    Gemma = "gemma",
    /// `gigachat`.
    Gigachat = "gigachat",
    /// `glmedge`.
    Glmedge = "glmedge",
    /// `gpt-oss` (Harmony, simplified).
    GptOss = "gpt-oss",
    /// `granite` (Granite 3.x).
    Granite = "granite",
    /// `granite-4.0`.
    Granite40 = "granite-4.0",
    /// `granite-4.1`.
    Granite41 = "granite-4.1",
    /// `grok-2`.
    Grok2 = "grok-2",
    /// `hunyuan-dense`.
    HunyuanDense = "hunyuan-dense",
    /// `hunyuan-moe`.
    HunyuanMoe = "hunyuan-moe",
    /// `hunyuan-vl`.
    HunyuanVl = "hunyuan-vl",
    /// `kimi-k2`.
    KimiK2 = "kimi-k2",
    /// `llama2`.
    Llama2 = "llama2",
    /// `llama2-sys`.
    Llama2Sys = "llama2-sys",
    /// `llama2-sys-bos`.
    Llama2SysBos = "llama2-sys-bos",
    /// `llama2-sys-strip`.
    Llama2SysStrip = "llama2-sys-strip",
    /// `llama3`.
    Llama3 = "llama3",
    /// `llama4`.
    Llama4 = "llama4",
    /// `megrez`.
    Megrez = "megrez",
    /// `minicpm`.
    Minicpm = "minicpm",
    /// `mistral-v1`.
    MistralV1 = "mistral-v1",
    /// `mistral-v3`.
    MistralV3 = "mistral-v3",
    /// `mistral-v3-tekken`.
    MistralV3Tekken = "mistral-v3-tekken",
    /// `mistral-v7`.
    MistralV7 = "mistral-v7",
    /// `mistral-v7-tekken`.
    MistralV7Tekken = "mistral-v7-tekken",
    /// `monarch` (AlphaMonarch).
    Monarch = "monarch",
    /// `openchat`.
    Openchat = "openchat",
    /// `orion`.
    Orion = "orion",
    /// `pangu-embedded`.
    PanguEmbedded = "pangu-embedded",
    /// `phi3`.
    Phi3 = "phi3",
    /// `phi4`.
    Phi4 = "phi4",
    /// `rwkv-world`.
    RwkvWorld = "rwkv-world",
    /// `seed_oss`.
    SeedOss = "seed_oss",
    /// `smolvlm`.
    Smolvlm = "smolvlm",
    /// `solar-open`.
    SolarOpen = "solar-open",
    /// `vicuna`.
    Vicuna = "vicuna",
    /// `vicuna-orca`.
    VicunaOrca = "vicuna-orca",
    /// `yandex`.
    Yandex = "yandex",
    /// `zephyr`.
    Zephyr = "zephyr",
}

impl std::fmt::Display for BuiltinTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// C `isspace` in the C locale.
fn is_c_space(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\n' | '\u{b}' | '\u{c}' | '\r')
}

/// llama.cpp's `trim`.
fn trim(s: &str) -> &str {
    s.trim_matches(is_c_space)
}

impl BuiltinTemplate {
    /// The built-in llama.cpp would use for this template string
    /// (`llm_chat_detect_template`): a built-in's name, or the built-in whose marker strings the
    /// Jinja source contains; `None` where llama.cpp does not recognise it.
    ///
    /// ```
    /// use token_stream::BuiltinTemplate;
    /// assert_eq!(BuiltinTemplate::detect("{{ '<|im_start|>' + m.role }}"), Some(BuiltinTemplate::Chatml));
    /// assert_eq!(BuiltinTemplate::detect("gemma"), Some(BuiltinTemplate::Gemma));
    /// assert_eq!(BuiltinTemplate::detect("{{ messages }}"), None);
    /// ```
    pub fn detect(tmpl: &str) -> Option<Self> {
        if let Ok(b) = tmpl.parse() {
            return Some(b);
        }
        let has = |s: &str| tmpl.contains(s);
        let t = if has("<|im_start|>") {
            if has("<|im_sep|>") {
                Self::Phi4
            } else if has("<end_of_utterance>") {
                Self::Smolvlm
            } else {
                Self::Chatml
            }
        } else if tmpl.starts_with("mistral") || has("[INST]") {
            if has("[SYSTEM_PROMPT]") {
                Self::MistralV7
            } else if has("' [INST] ' + system_message") || has("[AVAILABLE_TOOLS]") {
                if has(" [INST]") {
                    Self::MistralV1
                } else if has("\"[INST]\"") {
                    Self::MistralV3Tekken
                } else {
                    Self::MistralV3
                }
            } else if has("content.strip()") {
                Self::Llama2SysStrip
            } else if has("bos_token + '[INST]") {
                Self::Llama2SysBos
            } else if has("<<SYS>>") {
                Self::Llama2Sys
            } else {
                Self::Llama2
            }
        } else if has("<|assistant|>") && has("<|end|>") {
            Self::Phi3
        } else if has("[gMASK]<sop>") {
            Self::Chatglm4
        } else if has("<|assistant|>") && has("<|user|>") {
            if has("<|tool_declare|>") {
                Self::ExaoneMoe
            } else if has("</s>") {
                Self::Falcon3
            } else {
                Self::Glmedge
            }
        } else if has("<|{{ item['role'] }}|>") && has("<|begin_of_image|>") {
            Self::Glmedge
        } else if has("<|user|>") && has("<|endoftext|>") {
            Self::Zephyr
        } else if has("bos_token + message['role']") {
            Self::Monarch
        } else if has("<start_of_turn>") {
            Self::Gemma
        } else if has("'\\n\\nAssistant: ' + eos_token") {
            Self::Orion
        } else if has("GPT4 Correct ") {
            Self::Openchat
        } else if has("USER: ") && has("ASSISTANT: ") {
            if has("SYSTEM: ") {
                Self::VicunaOrca
            } else {
                Self::Vicuna
            }
        } else if has("### Instruction:") && has("<|EOT|>") {
            Self::Deepseek
        } else if has("<|START_OF_TURN_TOKEN|>") && has("<|USER_TOKEN|>") {
            Self::CommandR
        } else if has("<|start_header_id|>") && has("<|end_header_id|>") {
            Self::Llama3
        } else if has("[gMASK]sop") {
            Self::Chatglm3
        } else if has("<用户>") {
            Self::Minicpm
        } else if has("'Assistant: ' + message['content'] + eos_token") {
            Self::Deepseek2
        } else if has("<｜Assistant｜>") && has("<｜User｜>") && has("<｜end▁of▁sentence｜>")
        {
            Self::Deepseek3
        } else if has("[|system|]") && has("[|assistant|]") && has("[|endofturn|]") {
            if has("[|tool|]") {
                Self::Exaone4
            } else {
                Self::Exaone3
            }
        } else if has("rwkv-world") || has("{{- 'User: ' + message['content']|trim + '\\n\\n' -}}")
        {
            Self::RwkvWorld
        } else if has("<|start_of_role|>") {
            if has("<tool_call>") || has("<tools>") {
                if has("g4_default_system_message") {
                    Self::Granite40
                } else {
                    Self::Granite41
                }
            } else {
                Self::Granite
            }
        } else if has(
            "message['role'] + additional_special_tokens[0] + message['content'] + additional_special_tokens[1]",
        ) {
            Self::Gigachat
        } else if has("<|role_start|>") {
            Self::Megrez
        } else if has(" Ассистент:") {
            Self::Yandex
        } else if has("<role>ASSISTANT</role>") && has("'HUMAN'") {
            Self::Bailing
        } else if has("<role>ASSISTANT</role>") && has("\"HUMAN\"") && has("<think>") {
            Self::BailingThink
        } else if has("<role>ASSISTANT</role>") && has("<role>HUMAN</role>") && has("<|role_end|>")
        {
            Self::Bailing2
        } else if has("<|header_start|>") && has("<|header_end|>") {
            Self::Llama4
        } else if has("<|endofuserprompt|>") {
            Self::Dots1
        } else if has("<|extra_0|>") && has("<|extra_4|>") {
            Self::HunyuanMoe
        } else if has("<|start|>") && has("<|channel|>") {
            Self::GptOss
        } else if has("<｜hy_Assistant｜>") && has("<｜hy_begin▁of▁sentence｜>") {
            Self::HunyuanVl
        } else if has("<｜hy_Assistant｜>") && has("<｜hy_place▁holder▁no▁3｜>") {
            Self::HunyuanDense
        } else if has("<|im_assistant|>assistant<|im_middle|>") {
            Self::KimiK2
        } else if has("<seed:bos>") {
            Self::SeedOss
        } else if has("'Assistant: '  + message['content'] + '<|separator|>") {
            Self::Grok2
        } else if has("[unused9]系统：[unused10]") {
            Self::PanguEmbedded
        } else if has("<|begin|>") && has("<|end|>") && has("<|content|>") {
            Self::SolarOpen
        } else {
            return None;
        };
        Some(t)
    }

    /// Renders the conversation as llama.cpp's `llm_chat_apply_template` does (only role and
    /// content are used; some built-ins ignore `add_generation_prompt`, as in llama.cpp).
    ///
    /// ```
    /// use token_stream::{BuiltinTemplate, TemplateMessage};
    /// let s = BuiltinTemplate::Gemma.render(&[TemplateMessage::new("system", "Be brief."), TemplateMessage::new("user", " hi ")], true);
    /// assert_eq!(s, "<start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n<start_of_turn>model\n");
    /// ```
    pub fn render(self, messages: &[TemplateMessage<'_>], add_ass: bool) -> String {
        self.render_marked(messages, add_ass, None)
    }

    /// [`BuiltinTemplate::render`], with message text that holds special-token text wrapped in
    /// the encode markers when a marker is given. Built-ins read only role and content; the
    /// role is printed by a few (chatml, ...) and is marked there too.
    pub(super) fn render_marked(
        self,
        chat: &[TemplateMessage<'_>],
        add_ass: bool,
        marker: Option<Marker<'_>>,
    ) -> String {
        let mut ss = String::new();
        // Message text (already trimmed where llama.cpp trims it).
        let c = |s: &str| mark::text(marker, s);
        // `write!` to a String cannot fail.
        macro_rules! w {
            ($($t:tt)*) => {{ let _ = write!(ss, $($t)*); }};
        }
        match self {
            Self::Chatml => {
                for m in chat {
                    w!("<|im_start|>{}\n{}<|im_end|>\n", c(m.role), c(m.content));
                }
                if add_ass {
                    ss.push_str("<|im_start|>assistant\n");
                }
            }
            Self::MistralV7 | Self::MistralV7Tekken => {
                let sp = if self == Self::MistralV7 { " " } else { "" };
                for m in chat {
                    match m.role {
                        "system" => w!("[SYSTEM_PROMPT]{sp}{}[/SYSTEM_PROMPT]", c(m.content)),
                        "user" => w!("[INST]{sp}{}[/INST]", c(m.content)),
                        _ => w!("{sp}{}</s>", c(m.content)),
                    }
                }
            }
            Self::MistralV1 | Self::MistralV3 | Self::MistralV3Tekken => {
                let lead = if self == Self::MistralV1 { " " } else { "" };
                let trail = if self == Self::MistralV3Tekken {
                    ""
                } else {
                    " "
                };
                let trim_assistant = self == Self::MistralV3;
                let mut inside = false;
                for m in chat {
                    if !inside {
                        w!("{lead}[INST]{trail}");
                        inside = true;
                    }
                    match m.role {
                        "system" => w!("{}\n\n", c(m.content)),
                        "user" => w!("{}{lead}[/INST]", c(m.content)),
                        _ => {
                            let t = if trim_assistant {
                                trim(m.content)
                            } else {
                                m.content
                            };
                            w!("{trail}{}</s>", c(t));
                            inside = false;
                        }
                    }
                }
            }
            Self::Llama2 | Self::Llama2Sys | Self::Llama2SysBos | Self::Llama2SysStrip => {
                let support_system = self != Self::Llama2;
                let bos_inside = self == Self::Llama2SysBos;
                let strip = self == Self::Llama2SysStrip;
                let mut inside = true;
                ss.push_str("[INST] ");
                for m in chat {
                    let content = if strip { trim(m.content) } else { m.content };
                    if !inside {
                        inside = true;
                        ss.push_str(if bos_inside { "<s>[INST] " } else { "[INST] " });
                    }
                    match m.role {
                        "system" if support_system => {
                            w!("<<SYS>>\n{}\n<</SYS>>\n\n", c(content));
                        }
                        "system" => w!("{}\n", c(content)),
                        "user" => w!("{} [/INST]", c(content)),
                        _ => {
                            w!("{}</s>", c(content));
                            inside = false;
                        }
                    }
                }
            }
            Self::Phi3 => {
                for m in chat {
                    w!("<|{}|>\n{}<|end|>\n", c(m.role), c(m.content));
                }
                if add_ass {
                    ss.push_str("<|assistant|>\n");
                }
            }
            Self::Phi4 => {
                for m in chat {
                    w!(
                        "<|im_start|>{}<|im_sep|>{}<|im_end|>",
                        c(m.role),
                        c(m.content)
                    );
                }
                if add_ass {
                    ss.push_str("<|im_start|>assistant<|im_sep|>");
                }
            }
            Self::Falcon3 => {
                for m in chat {
                    w!("<|{}|>\n{}\n", c(m.role), c(m.content));
                }
                if add_ass {
                    ss.push_str("<|assistant|>\n");
                }
            }
            Self::Zephyr => {
                for m in chat {
                    w!("<|{}|>\n{}<|endoftext|>\n", c(m.role), c(m.content));
                }
                if add_ass {
                    ss.push_str("<|assistant|>\n");
                }
            }
            Self::Monarch => {
                for (i, m) in chat.iter().enumerate() {
                    let bos = if i == 0 { "" } else { "<s>" };
                    w!("{bos}{}\n{}</s>\n", c(m.role), c(m.content));
                }
                if add_ass {
                    ss.push_str("<s>assistant\n");
                }
            }
            Self::Gemma => {
                let mut system = String::new();
                for m in chat {
                    if m.role == "system" {
                        system.push_str(&c(trim(m.content)));
                        continue;
                    }
                    let role = if m.role == "assistant" {
                        "model"
                    } else {
                        m.role
                    };
                    w!("<start_of_turn>{}\n", c(role));
                    if !system.is_empty() && role != "model" {
                        w!("{system}\n\n");
                        system.clear();
                    }
                    w!("{}<end_of_turn>\n", c(trim(m.content)));
                }
                if add_ass {
                    ss.push_str("<start_of_turn>model\n");
                }
            }
            Self::Orion => {
                let mut system = String::new();
                for m in chat {
                    match m.role {
                        "system" => system.push_str(&c(m.content)),
                        "user" => {
                            ss.push_str("Human: ");
                            if !system.is_empty() {
                                w!("{system}\n\n");
                                system.clear();
                            }
                            w!("{}\n\nAssistant: </s>", c(m.content));
                        }
                        _ => w!("{}</s>", c(m.content)),
                    }
                }
            }
            Self::Openchat => {
                for m in chat {
                    if m.role == "system" {
                        w!("{}<|end_of_turn|>", c(m.content));
                    } else {
                        let mut role = m.role.as_bytes().to_vec();
                        if let Some(b) = role.first_mut() {
                            b.make_ascii_uppercase();
                        }
                        let role = String::from_utf8_lossy(&role);
                        w!("GPT4 Correct {}: {}<|end_of_turn|>", c(&role), c(m.content));
                    }
                }
                if add_ass {
                    ss.push_str("GPT4 Correct Assistant:");
                }
            }
            Self::Vicuna | Self::VicunaOrca => {
                for m in chat {
                    match m.role {
                        "system" if self == Self::VicunaOrca => w!("SYSTEM: {}\n", c(m.content)),
                        "system" => w!("{}\n\n", c(m.content)),
                        "user" => w!("USER: {}\n", c(m.content)),
                        "assistant" => w!("ASSISTANT: {}</s>\n", c(m.content)),
                        _ => {}
                    }
                }
                if add_ass {
                    ss.push_str("ASSISTANT:");
                }
            }
            Self::Deepseek => {
                for m in chat {
                    match m.role {
                        "system" => ss.push_str(&c(m.content)),
                        "user" => w!("### Instruction:\n{}\n", c(m.content)),
                        "assistant" => w!("### Response:\n{}\n<|EOT|>\n", c(m.content)),
                        _ => {}
                    }
                }
                if add_ass {
                    ss.push_str("### Response:\n");
                }
            }
            Self::CommandR => {
                for m in chat {
                    let tag = match m.role {
                        "system" => "<|SYSTEM_TOKEN|>",
                        "user" => "<|USER_TOKEN|>",
                        "assistant" => "<|CHATBOT_TOKEN|>",
                        _ => continue,
                    };
                    w!(
                        "<|START_OF_TURN_TOKEN|>{tag}{}<|END_OF_TURN_TOKEN|>",
                        c(trim(m.content))
                    );
                }
                if add_ass {
                    ss.push_str("<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>");
                }
            }
            Self::Llama3 => {
                for m in chat {
                    w!(
                        "<|start_header_id|>{}<|end_header_id|>\n\n{}<|eot_id|>",
                        c(m.role),
                        c(trim(m.content))
                    );
                }
                if add_ass {
                    ss.push_str("<|start_header_id|>assistant<|end_header_id|>\n\n");
                }
            }
            Self::Chatglm3 => {
                ss.push_str("[gMASK]sop");
                for m in chat {
                    w!("<|{}|>\n {}", c(m.role), c(m.content));
                }
                if add_ass {
                    ss.push_str("<|assistant|>");
                }
            }
            Self::Chatglm4 => {
                ss.push_str("[gMASK]<sop>");
                for m in chat {
                    w!("<|{}|>\n{}", c(m.role), c(m.content));
                }
                if add_ass {
                    ss.push_str("<|assistant|>\n");
                }
            }
            Self::Glmedge => {
                for m in chat {
                    w!("<|{}|>\n{}", c(m.role), c(m.content));
                }
                if add_ass {
                    ss.push_str("<|assistant|>");
                }
            }
            Self::Minicpm => {
                for m in chat {
                    if m.role == "user" {
                        w!("<用户>{}<AI>", c(trim(m.content)));
                    } else {
                        ss.push_str(&c(trim(m.content)));
                    }
                }
            }
            Self::Deepseek2 => {
                for m in chat {
                    match m.role {
                        "system" => w!("{}\n\n", c(m.content)),
                        "user" => w!("User: {}\n\n", c(m.content)),
                        "assistant" => w!("Assistant: {}<｜end▁of▁sentence｜>", c(m.content)),
                        _ => {}
                    }
                }
                if add_ass {
                    ss.push_str("Assistant:");
                }
            }
            Self::Deepseek3 => {
                for m in chat {
                    match m.role {
                        "system" => w!("{}\n\n", c(m.content)),
                        "user" => w!("<｜User｜>{}", c(m.content)),
                        "assistant" => {
                            w!("<｜Assistant｜>{}<｜end▁of▁sentence｜>", c(m.content));
                        }
                        _ => {}
                    }
                }
                if add_ass {
                    ss.push_str("<｜Assistant｜>");
                }
            }
            Self::DeepseekOcr => {
                for m in chat {
                    ss.push_str(&c(m.content));
                }
            }
            Self::Exaone3 | Self::Exaone4 => {
                for m in chat {
                    let t = c(trim(m.content));
                    match m.role {
                        "system" => w!("[|system|]{t}[|endofturn|]\n"),
                        "user" => w!("[|user|]{t}\n"),
                        "assistant" => w!("[|assistant|]{t}[|endofturn|]\n"),
                        "tool" if self == Self::Exaone4 => w!("[|tool|]{t}[|endofturn|]\n"),
                        _ => {}
                    }
                }
                if add_ass {
                    ss.push_str("[|assistant|]");
                }
            }
            Self::ExaoneMoe => {
                for m in chat {
                    if matches!(m.role, "system" | "user" | "assistant" | "tool") {
                        w!("<|{}|>\n{}<|endofturn|>\n", c(m.role), c(trim(m.content)));
                    }
                }
                if add_ass {
                    ss.push_str("<|assistant|>\n");
                }
            }
            Self::RwkvWorld => {
                for (i, m) in chat.iter().enumerate() {
                    let t = c(trim(m.content));
                    match m.role {
                        "system" => w!("System: {t}\n\n"),
                        "user" => {
                            w!("User: {t}\n\n");
                            if i == chat.len() - 1 {
                                ss.push_str("Assistant:");
                            }
                        }
                        "assistant" => w!("Assistant: {t}\n\n"),
                        _ => {}
                    }
                }
            }
            Self::Granite => {
                for m in chat {
                    w!("<|start_of_role|>{}<|end_of_role|>", c(m.role));
                    if m.role == "assistant_tool_call" {
                        ss.push_str("<|tool_call|>");
                    }
                    w!("{}<|end_of_text|>\n", c(m.content));
                }
                if add_ass {
                    ss.push_str("<|start_of_role|>assistant<|end_of_role|>");
                }
            }
            Self::Granite40 | Self::Granite41 => {
                for m in chat {
                    if m.role == "assistant_tool_call" {
                        ss.push_str("<|start_of_role|>assistant<|end_of_role|><|tool_call|>");
                    } else {
                        w!("<|start_of_role|>{}<|end_of_role|>", c(m.role));
                    }
                    w!("{}<|end_of_text|>\n", c(m.content));
                }
                if add_ass {
                    ss.push_str("<|start_of_role|>assistant<|end_of_role|>");
                }
            }
            Self::Gigachat => {
                let has_system = chat.first().is_some_and(|m| m.role == "system");
                if has_system {
                    w!("<s>{}<|message_sep|>", c(chat[0].content));
                } else {
                    ss.push_str("<s>");
                }
                for m in &chat[usize::from(has_system)..] {
                    match m.role {
                        "user" => w!(
                            "user<|role_sep|>{}<|message_sep|>available functions<|role_sep|>[]<|message_sep|>",
                            c(m.content)
                        ),
                        "assistant" => w!("assistant<|role_sep|>{}<|message_sep|>", c(m.content)),
                        _ => {}
                    }
                }
                if add_ass {
                    ss.push_str("assistant<|role_sep|>");
                }
            }
            Self::Megrez => {
                for m in chat {
                    w!(
                        "<|role_start|>{}<|role_end|>{}<|turn_end|>",
                        c(m.role),
                        c(m.content)
                    );
                }
                if add_ass {
                    ss.push_str("<|role_start|>assistant<|role_end|>");
                }
            }
            Self::Yandex => {
                for m in chat {
                    match m.role {
                        "user" => w!(" Пользователь: {}\n\n", c(m.content)),
                        "assistant" => w!(" Ассистент: {}\n\n", c(m.content)),
                        _ => {}
                    }
                }
                if add_ass {
                    ss.push_str(" Ассистент:[SEP]");
                }
            }
            Self::Bailing | Self::BailingThink | Self::Bailing2 => {
                let two = self == Self::Bailing2;
                if two && chat.first().is_none_or(|m| m.role != "system") {
                    ss.push_str("<role>SYSTEM</role>detailed thinking off<|role_end|>");
                }
                for m in chat {
                    let role = if m.role == "user" {
                        "HUMAN".to_owned()
                    } else {
                        m.role.to_ascii_uppercase()
                    };
                    w!("<role>{}</role>{}", c(&role), c(m.content));
                    if two {
                        ss.push_str("<|role_end|>");
                    }
                }
                if add_ass {
                    ss.push_str("<role>ASSISTANT</role>");
                    if self == Self::BailingThink {
                        ss.push_str("<think>");
                    }
                }
            }
            Self::Llama4 => {
                for m in chat {
                    w!(
                        "<|header_start|>{}<|header_end|>\n\n{}<|eot|>",
                        c(m.role),
                        c(trim(m.content))
                    );
                }
                if add_ass {
                    ss.push_str("<|header_start|>assistant<|header_end|>\n\n");
                }
            }
            Self::Smolvlm => {
                ss.push_str("<|im_start|>");
                for m in chat {
                    match m.role {
                        "system" => w!("{}\n\n", c(m.content)),
                        "user" => w!("User: {}<end_of_utterance>\n", c(m.content)),
                        _ => w!("Assistant: {}<end_of_utterance>\n", c(m.content)),
                    }
                }
                if add_ass {
                    ss.push_str("Assistant:");
                }
            }
            Self::Dots1 => {
                for m in chat {
                    match m.role {
                        "system" => w!("<|system|>{}<|endofsystem|>", c(m.content)),
                        "user" => w!("<|userprompt|>{}<|endofuserprompt|>", c(m.content)),
                        _ => w!("<|response|>{}<|endofresponse|>", c(m.content)),
                    }
                }
                if add_ass {
                    ss.push_str("<|response|>");
                }
            }
            Self::HunyuanMoe => {
                for m in chat {
                    match m.role {
                        "system" => w!("<|startoftext|>{}<|extra_4|>", c(m.content)),
                        "assistant" => w!("{}<|eos|>", c(m.content)),
                        _ => w!("<|startoftext|>{}<|extra_0|>", c(m.content)),
                    }
                }
            }
            Self::GptOss => {
                for m in chat {
                    w!("<|start|>{}<|message|>{}", c(m.role), c(m.content));
                    ss.push_str(if m.role == "assistant" {
                        "<|return|>"
                    } else {
                        "<|end|>"
                    });
                }
                if add_ass {
                    ss.push_str("<|start|>assistant");
                }
            }
            Self::HunyuanDense => {
                for (i, m) in chat.iter().enumerate() {
                    if i == 0 && m.role == "system" {
                        w!("{}<｜hy_place▁holder▁no▁3｜>", c(m.content));
                    }
                    match m.role {
                        "assistant" => {
                            w!(
                                "<｜hy_Assistant｜>{}<｜hy_place▁holder▁no▁2｜>",
                                c(m.content)
                            );
                        }
                        "user" => w!("<｜hy_User｜>{}<｜hy_Assistant｜>", c(m.content)),
                        _ => {}
                    }
                }
            }
            Self::HunyuanVl => {
                ss.push_str("<｜hy_begin▁of▁sentence｜>");
                for (i, m) in chat.iter().enumerate() {
                    if i == 0 && m.role == "system" {
                        w!("{}<｜hy_place▁holder▁no▁3｜>", c(m.content));
                        continue;
                    }
                    match m.role {
                        "user" => w!("{}<｜hy_User｜>", c(m.content)),
                        "assistant" => w!("{}<｜hy_Assistant｜>", c(m.content)),
                        _ => {}
                    }
                }
            }
            Self::KimiK2 => {
                for m in chat {
                    ss.push_str(match m.role {
                        "system" => "<|im_system|>system<|im_middle|>",
                        "user" => "<|im_user|>user<|im_middle|>",
                        "assistant" => "<|im_assistant|>assistant<|im_middle|>",
                        "tool" => "<|im_system|>tool<|im_middle|>",
                        _ => "",
                    });
                    w!("{}<|im_end|>", c(m.content));
                }
                if add_ass {
                    ss.push_str("<|im_assistant|>assistant<|im_middle|>");
                }
            }
            Self::SeedOss => {
                for m in chat {
                    let t = if m.role == "assistant" {
                        trim(m.content)
                    } else {
                        m.content
                    };
                    w!("<seed:bos>{}\n{}<seed:eos>", c(m.role), c(t));
                }
                if add_ass {
                    ss.push_str("<seed:bos>assistant\n");
                }
            }
            Self::Grok2 => {
                for m in chat {
                    match m.role {
                        "system" => w!("System: {}<|separator|>\n\n", c(trim(m.content))),
                        "user" => w!("Human: {}<|separator|>\n\n", c(trim(m.content))),
                        "assistant" => w!("Assistant: {}<|separator|>\n\n", c(m.content)),
                        _ => {}
                    }
                }
                if add_ass {
                    ss.push_str("Assistant:");
                }
            }
            Self::PanguEmbedded => {
                for (i, m) in chat.iter().enumerate() {
                    if i == 0 && m.role != "system" {
                        ss.push_str("[unused9]系统：[unused10]");
                    }
                    let label = match m.role {
                        "system" => "系统",
                        "user" => "用户",
                        "assistant" => "助手",
                        "tool" => "工具",
                        "function" => "方法",
                        _ => continue,
                    };
                    w!("[unused9]{label}：{}[unused10]", c(m.content));
                }
                if add_ass {
                    ss.push_str("[unused9]助手：");
                }
            }
            Self::SolarOpen => {
                for m in chat {
                    w!("<|begin|>{}<|content|>{}<|end|>", c(m.role), c(m.content));
                }
                if add_ass {
                    ss.push_str("<|begin|>assistant");
                }
            }
        }
        ss
    }
}

//! End to end, one model per architecture family: greedy generation through the server's
//! `POST /v1/messages` (HTTP/1.1, JSON and SSE) equals a direct greedy run of the same engine
//! on the prompt rendered by the model's chat template, and stops for the right reason.
//!
//! Per model, the test starts the [`EngineService`] and the gateway on a loopback port and checks
//! - `/v1/models` and `/v1/models/{id}` (percent-encoded) list the model under its own name, and a
//!   request naming another model gets 404 `not_found_error`;
//! - the chat template: the prompt the service tokenizes is the one token-stream renders, and
//!   the rendered text starts with the family's expected prefix and ends with its assistant
//!   header (a model that fell back to another template fails here);
//! - the stop tokens: the family's end-of-turn token is a special token and one of the engine's
//!   default stop tokens;
//! - generation: text, `usage` and `stop_reason` (`max_tokens`, or `end_turn` when the model's
//!   end-of-generation token comes first) of the JSON and the streamed answers equal the direct
//!   run's; the token ids the service streams equal the direct run's ids; a stop sequence taken
//!   from the answer ends it with `stop_sequence` at the right place; for the default model, a
//!   prompt it answers in a few words ends with `end_turn`.
//!
//! Models: `arch-<family>.gguf` (random weights, `scripts/make_arch_models.py`) and
//! `tiny-*.gguf` (random Llama with SmolLM2's tokenizer, `scripts/make-test-models`) in
//! `$ZEROLAYER_TEST_MODELS` (default `~/.cache/zerolayer/test-models`), and the default model.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use serde_json::{Value, json};
use zerolayer::EngineService;
use zerolayer::claudelink_proto::futures::StreamExt as _;
use zerolayer::claudelink_proto::{
    ChatMessage as Msg, ChatRole, InferenceEvent, InferenceRequest, InferenceService, Prompt,
    ToolCallMessage, ToolDefinition, Tools,
};
use zerolayer::gpu_pipeline::engine::GenerationRequest;
use zerolayer::gpu_pipeline::{ModelOptions, StopReason};
use zerolayer::token_stream::{ChatTemplate, TemplateMessage, Tokenizer, ToolSyntax};
use zerolayer::zerolayer_gateway::{Gateway, GatewayConfig};

/// The user turn of every request.
const PROMPT: &str = "Name three colors of the rainbow.";
/// `max_tokens` of the main requests.
const MAX_TOKENS: usize = 12;

/// What a family's chat template and vocabulary look like.
struct Family {
    /// The rendered prompt starts with one of these.
    prefixes: &'static [&'static str],
    /// The rendered prompt ends with this (the generation prompt).
    assistant_header: &'static str,
    /// The token that closes a turn; the engine must stop on it.
    end_of_turn: &'static str,
}

/// The ChatML template of gpu-pipeline's Hugging Face fixtures, after the BOS text.
const HF_CHATML: Family = Family {
    prefixes: &["<s><|im_start|>user\n"],
    assistant_header: "<|im_start|>assistant\n",
    end_of_turn: "<|im_end|>",
};

/// ChatML (SmolLM2, SmolLM3, Qwen): a system turn first when the template adds a default one.
const CHATML: Family = Family {
    prefixes: &["<|im_start|>system\n", "<|im_start|>user\n"],
    assistant_header: "<|im_start|>assistant\n",
    end_of_turn: "<|im_end|>",
};
const LLAMA3: Family = Family {
    prefixes: &["<|begin_of_text|><|start_header_id|>"],
    assistant_header: "<|start_header_id|>assistant<|end_header_id|>\n\n",
    end_of_turn: "<|eot_id|>",
};
const GEMMA: Family = Family {
    // Gemma's own vocabulary has `<bos>`; the test models carry llama-spm's (`<s>`).
    prefixes: &["<bos><start_of_turn>user\n", "<s><start_of_turn>user\n"],
    assistant_header: "<start_of_turn>model\n",
    end_of_turn: "<end_of_turn>",
};
const PHI3: Family = Family {
    prefixes: &[
        "<|user|>\n",
        "<s><|user|>\n",
        "<|system|>\n",
        "<s><|system|>\n",
    ],
    assistant_header: "<|assistant|>\n",
    end_of_turn: "<|end|>",
};

/// Where a model file is.
enum Location {
    /// `$ZEROLAYER_TEST_MODELS/<name>`.
    TestModels(&'static str),
    /// The default model (`weight_cache::locate_default_model`).
    Default,
    /// A Hugging Face model directory of gpu-pipeline's fixtures
    /// (`crates/gpu-pipeline/tests/fixtures/hf/<name>`).
    HfFixture(&'static str),
}

/// The test-model directory, as the gpu-pipeline tests find it.
fn test_models_dir() -> PathBuf {
    std::env::var_os("ZEROLAYER_TEST_MODELS").map_or_else(
        || {
            let home = std::env::var_os("HOME").expect("HOME or ZEROLAYER_TEST_MODELS");
            PathBuf::from(home).join(".cache/zerolayer/test-models")
        },
        PathBuf::from,
    )
}

fn path_of(location: &Location) -> PathBuf {
    match location {
        Location::TestModels(name) => {
            let p = test_models_dir().join(name);
            assert!(
                p.exists(),
                "{} is missing: run scripts/make_arch_models.py (arch-*) or \
                 scripts/make-test-models (tiny-*)",
                p.display()
            );
            p
        }
        Location::Default => weight_cache::locate_default_model().unwrap_or_else(|e| panic!("{e}")),
        Location::HfFixture(name) => PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("crates/gpu-pipeline/tests/fixtures/hf")
            .join(name),
    }
}

/// The service and the gateway on a loopback port; the gateway stops on drop.
struct Server {
    svc: Arc<EngineService>,
    addr: SocketAddr,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn start(location: &Location) -> Server {
    let path = path_of(location);
    // SAFETY: the test never modifies the model files.
    let svc = unsafe { EngineService::load(&path, ModelOptions::default(), Default::default()) }
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let svc = Arc::new(svc);
    let service: Arc<dyn InferenceService> = svc.clone();
    let gateway = Gateway::new(service, GatewayConfig::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let _ = gateway
            .serve_tcp(listener, async {
                let _ = stopped.await;
            })
            .await;
    });
    Server {
        svc,
        addr,
        _stop: stop,
    }
}

/// A response: status and body.
struct Response {
    status: u16,
    body: Bytes,
}

impl Response {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&self.body)))
    }
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// One HTTP/1.1 request on a fresh connection.
async fn request(addr: SocketAddr, method: &str, path: &str, body: Option<&Value>) -> Response {
    let io = hyper_util::rt::TokioIo::new(tokio::net::TcpStream::connect(addr).await.unwrap());
    let (mut send, conn) = hyper::client::conn::http1::handshake(io).await.unwrap();
    tokio::spawn(conn);
    let builder = http::Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr.to_string())
        .header("anthropic-version", "2023-06-01");
    let resp = match body {
        Some(b) => {
            let req = builder
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(b.to_string())))
                .unwrap();
            send.send_request(req).await.unwrap()
        }
        None => {
            let req = builder.body(Full::new(Bytes::new())).unwrap();
            send.send_request(req).await.unwrap()
        }
    };
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    Response { status, body }
}

/// `(event, data)` of each SSE event.
fn parse_sse(text: &str) -> Vec<(String, Value)> {
    text.split("\n\n")
        .filter(|b| !b.trim().is_empty())
        .map(|block| {
            let mut name = String::new();
            let mut data = String::new();
            for line in block.lines() {
                if let Some(n) = line.strip_prefix("event:") {
                    name = n.trim().to_string();
                } else if let Some(d) = line.strip_prefix("data:") {
                    data.push_str(d.trim_start());
                }
            }
            (name, serde_json::from_str(&data).unwrap_or(Value::Null))
        })
        .collect()
}

/// What a direct greedy run of the engine produced.
#[derive(Debug)]
struct Greedy {
    ids: Vec<u32>,
    text: String,
    stop_reason: StopReason,
}

/// Greedy generation straight from the service's engine, bypassing the service and gateway.
fn direct_greedy(svc: &EngineService, prompt: Vec<u32>, max_tokens: usize) -> Greedy {
    let done = svc
        .engine()
        .generate(GenerationRequest::new(prompt, max_tokens), &mut |_| {})
        .expect("generate");
    Greedy {
        ids: done.ids,
        text: done.text,
        stop_reason: done.stop_reason,
    }
}

fn messages_body(model: &str, prompt: &str, max_tokens: usize, stream: bool) -> Value {
    json!({
        "model": model, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
        "messages": [{"role": "user", "content": prompt}],
    })
}

/// Text, stop_reason, stop_sequence, usage of a streamed answer, checking the event order.
fn collect_stream(resp: &Response) -> (String, Value, Value, Value) {
    assert_eq!(resp.status, 200, "{}", resp.text());
    let events = parse_sse(&resp.text());
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.first(), Some(&"message_start"), "{names:?}");
    assert_eq!(names.last(), Some(&"message_stop"), "{names:?}");
    let mut text = String::new();
    let (mut stop_reason, mut stop_sequence, mut usage) = (Value::Null, Value::Null, json!({}));
    for (name, data) in &events {
        match name.as_str() {
            "message_start" => {
                usage["input_tokens"] = data["message"]["usage"]["input_tokens"].clone();
            }
            "content_block_delta" => {
                assert_eq!(data["delta"]["type"], "text_delta", "{data}");
                text.push_str(data["delta"]["text"].as_str().unwrap());
            }
            "message_delta" => {
                stop_reason = data["delta"]["stop_reason"].clone();
                stop_sequence = data["delta"]["stop_sequence"].clone();
                usage["output_tokens"] = data["usage"]["output_tokens"].clone();
            }
            "error" => panic!("error event: {data}"),
            _ => {}
        }
    }
    (text, stop_reason, stop_sequence, usage)
}

/// Percent-encodes everything but unreserved characters (RFC 3986).
fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The expected served id: `general.name` trimmed, else the file name without extension.
fn expected_id(svc: &EngineService, location: &Location) -> String {
    match svc
        .engine()
        .model()
        .source()
        .get_str("general.name")
        .map(str::trim)
    {
        Some(n) if !n.is_empty() => n.to_string(),
        _ => path_of(location)
            .file_stem()
            .unwrap()
            .to_string_lossy()
            .into_owned(),
    }
}

/// `/v1/models`, `/v1/models/{id}` and an unknown model.
async fn check_model_listing(s: &Server, id: &str) {
    let models = request(s.addr, "GET", "/v1/models", None).await;
    assert_eq!(models.status, 200, "{}", models.text());
    let v = models.json();
    assert_eq!(v["data"].as_array().map(Vec::len), Some(1), "{v}");
    assert_eq!(v["data"][0]["id"], id);
    let one = request(
        s.addr,
        "GET",
        &format!("/v1/models/{}", percent_encode(id)),
        None,
    )
    .await;
    assert_eq!(one.status, 200, "{}", one.text());
    assert_eq!(one.json()["id"], id);
    let other = request(
        s.addr,
        "POST",
        "/v1/messages",
        Some(&messages_body("no-such-model", PROMPT, 2, false)),
    )
    .await;
    assert_eq!(other.status, 404, "{}", other.text());
    assert_eq!(other.json()["error"]["type"], "not_found_error");
}

/// Renders the prompt with token-stream directly; checks the service renders the same and that
/// it has the family's shape and stop token. Returns the prompt ids.
fn check_template_and_stop_tokens(svc: &EngineService, family: &Family, prompt: &str) -> Vec<u32> {
    // The tokenizer and template as the model's files give them, read here independently of
    // the service: GGUF metadata, or a Hugging Face directory's tokenizer.json and
    // tokenizer_config.json (template, BOS/EOS text).
    let (tok, chat) = match svc.engine().model().gguf() {
        Some(gguf) => {
            let tok = Tokenizer::from_gguf(gguf).expect("tokenizer");
            let chat = ChatTemplate::from_tokenizer(&tok).expect("chat template");
            (tok, chat)
        }
        None => {
            let src = svc.engine().model().source();
            let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("crates/gpu-pipeline/tests/fixtures/hf")
                .join(src.model_name().expect("a directory name"));
            let tok = Tokenizer::from_tokenizer_json_file(dir.join("tokenizer.json"))
                .expect("tokenizer.json");
            let cfg: Value = serde_json::from_str(
                &std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap(),
            )
            .unwrap();
            let text = |k: &str| cfg[k].as_str().unwrap_or_default().to_string();
            let chat = ChatTemplate::new(
                &text("chat_template"),
                &text("bos_token"),
                &text("eos_token"),
            )
            .expect("the directory's chat template");
            (tok, chat)
        }
    };
    let turn = [TemplateMessage::new("user", prompt)];
    let rendered = chat.render(&turn, true).expect("render");
    let ids = chat.encode(&tok, &turn, true).expect("encode").to_vec();
    assert_eq!(ids, tok.encode_with_specials(&rendered).to_vec());
    let served = svc
        .tokenize(&Prompt::Chat(vec![Msg::new(ChatRole::User, prompt)]))
        .expect("the service renders the chat prompt");
    assert_eq!(
        served, ids,
        "the service rendered another prompt than {rendered:?}"
    );
    assert!(
        family.prefixes.iter().any(|p| rendered.starts_with(p)),
        "the rendered prompt {rendered:?} starts with none of {:?}",
        family.prefixes
    );
    assert!(
        rendered.ends_with(family.assistant_header),
        "the rendered prompt {rendered:?} does not end with {:?}",
        family.assistant_header
    );
    assert!(rendered.contains(prompt), "{rendered:?}");
    let eot = tok
        .special_id(family.end_of_turn)
        .unwrap_or_else(|| panic!("no special token {:?}", family.end_of_turn));
    let stops = svc.engine().stop_tokens();
    assert!(
        stops.contains(&eot),
        "{:?} ({eot}) is not among the stop tokens {stops:?}",
        family.end_of_turn
    );
    ids
}

/// The service's own stream (below HTTP) yields the direct run's token ids.
async fn check_service_ids(svc: &EngineService, prompt: &str, max_tokens: usize, want: &[u32]) {
    let chat = Prompt::Chat(vec![Msg::new(ChatRole::User, prompt)]);
    let events: Vec<InferenceEvent> = svc
        .submit(InferenceRequest::new(
            svc.model_id(),
            chat,
            max_tokens as u32,
        ))
        .unwrap()
        .collect()
        .await;
    let ids: Vec<u32> = events
        .iter()
        .flat_map(|e| match e {
            InferenceEvent::Delta { ids, .. } => ids.clone(),
            _ => vec![],
        })
        .collect();
    assert_eq!(ids, want, "service stream ids vs direct greedy ids");
}

/// JSON and SSE answers to `prompt` equal the direct greedy run; returns the run.
async fn check_generation(
    s: &Server,
    id: &str,
    prompt_ids: &[u32],
    prompt: &str,
    max_tokens: usize,
) -> Greedy {
    let want = direct_greedy(&s.svc, prompt_ids.to_vec(), max_tokens);
    assert!(
        !want.ids.is_empty() || want.stop_reason == StopReason::EndTurn,
        "{want:?}"
    );
    eprintln!("{id}: {prompt:?} -> {want:?}");
    let reason = want.stop_reason.as_str();
    if want.stop_reason == StopReason::MaxTokens {
        assert_eq!(want.ids.len(), max_tokens);
    }
    // The engine's detokenized text is the ids' text without special tokens. `decode` drops
    // the one space SPM vocabularies add at a text's start; generated text continues a prompt,
    // so the engine keeps it (as llama.cpp's server streams it).
    let tok = (s.svc.engine().tokenizer()).expect("the service's engine has the tokenizer");
    let plain: Vec<u32> = (want.ids.iter().copied())
        .filter(|&t| !tok.is_special(t))
        .collect();
    let decoded = tok.decode(&plain).unwrap();
    assert!(
        want.text == decoded || want.text.strip_prefix(' ') == Some(decoded.as_str()),
        "engine text {:?} vs decode(ids) {decoded:?}",
        want.text
    );
    check_service_ids(&s.svc, prompt, max_tokens, &want.ids).await;
    let usage = json!({"input_tokens": prompt_ids.len(), "output_tokens": want.ids.len()});

    let r = request(
        s.addr,
        "POST",
        "/v1/messages",
        Some(&messages_body(id, prompt, max_tokens, false)),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["model"], id);
    let text: String = v["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["text"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(text, want.text, "JSON answer vs direct greedy run");
    assert_eq!(v["stop_reason"], reason, "{v}");
    assert_eq!(v["stop_sequence"], Value::Null);
    assert_eq!(v["usage"]["input_tokens"], usage["input_tokens"], "{v}");
    assert_eq!(v["usage"]["output_tokens"], usage["output_tokens"], "{v}");

    let r = request(
        s.addr,
        "POST",
        "/v1/messages",
        Some(&messages_body(id, prompt, max_tokens, true)),
    )
    .await;
    let (text, stop_reason, stop_sequence, got_usage) = collect_stream(&r);
    assert_eq!(text, want.text, "streamed answer vs direct greedy run");
    assert_eq!(stop_reason, reason);
    assert_eq!(stop_sequence, Value::Null);
    assert_eq!(got_usage, usage);
    want
}

/// A stop sequence taken from the answer ends it there with `stop_sequence`.
async fn check_stop_sequence(s: &Server, id: &str, prompt: &str, want: &Greedy) {
    // The first word of the answer after its first few characters.
    let Some(stop) = want
        .text
        .char_indices()
        .skip(2)
        .map(|(i, _)| &want.text[i..])
        .find_map(|rest| {
            let w: String = rest.chars().take_while(|c| c.is_alphanumeric()).collect();
            (!w.is_empty()).then_some(w)
        })
    else {
        eprintln!("no word in {:?}: stop-sequence case skipped", want.text);
        return;
    };
    let cut = &want.text[..want.text.find(&stop).unwrap()];
    let mut body = messages_body(id, prompt, MAX_TOKENS, false);
    body["stop_sequences"] = json!([stop]);
    let r = request(s.addr, "POST", "/v1/messages", Some(&body)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["stop_reason"], "stop_sequence", "{v}");
    assert_eq!(v["stop_sequence"], stop);
    let text = v["content"][0]["text"].as_str().unwrap_or_default();
    assert_eq!(text, cut, "stop sequence {stop:?} in {:?}", want.text);
    body["stream"] = json!(true);
    let r = request(s.addr, "POST", "/v1/messages", Some(&body)).await;
    let (text, stop_reason, stop_sequence, _) = collect_stream(&r);
    assert_eq!(text, cut);
    assert_eq!(stop_reason, "stop_sequence");
    assert_eq!(stop_sequence, stop);
}

/// The whole check for one model; `end_turn` is a prompt the model answers with its
/// end-of-turn token within the given number of tokens.
async fn check_model(location: Location, family: &Family, end_turn: Option<(&str, usize)>) {
    let s = start(&location).await;
    let id = expected_id(&s.svc, &location);
    assert_eq!(s.svc.model_id(), id);
    check_model_listing(&s, &id).await;
    let prompt_ids = check_template_and_stop_tokens(&s.svc, family, PROMPT);
    let want = check_generation(&s, &id, &prompt_ids, PROMPT, MAX_TOKENS).await;
    check_stop_sequence(&s, &id, PROMPT, &want).await;
    if let Some((prompt, max_tokens)) = end_turn {
        let ids = check_template_and_stop_tokens(&s.svc, family, prompt);
        let got = check_generation(&s, &id, &ids, prompt, max_tokens).await;
        assert_eq!(got.stop_reason, StopReason::EndTurn, "{got:?}");
    }
}

macro_rules! arch_tests {
    ($($name:ident => $location:expr, $family:expr, $end_turn:expr;)*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            check_model($location, &$family, $end_turn).await;
        }
    )*};
}

arch_tests! {
    greedy_generation_is_wired_end_to_end_for_the_default_model =>
        Location::Default, CHATML, Some(("Reply with one word: is the sky blue?", 48));
    greedy_generation_is_wired_end_to_end_for_tiny_tied_f32 =>
        Location::TestModels("tiny-tied.F32.gguf"), CHATML, None;
    greedy_generation_is_wired_end_to_end_for_tiny_untied_q4_k_m =>
        Location::TestModels("tiny-untied.Q4_K_M.gguf"), CHATML, None;
    greedy_generation_is_wired_end_to_end_for_llama3 =>
        Location::TestModels("arch-llama3.gguf"), LLAMA3, None;
    greedy_generation_is_wired_end_to_end_for_qwen2 =>
        Location::TestModels("arch-qwen2.gguf"), CHATML, None;
    greedy_generation_is_wired_end_to_end_for_qwen3 =>
        Location::TestModels("arch-qwen3.gguf"), CHATML, None;
    greedy_generation_is_wired_end_to_end_for_gemma2 =>
        Location::TestModels("arch-gemma2.gguf"), GEMMA, None;
    greedy_generation_is_wired_end_to_end_for_gemma3 =>
        Location::TestModels("arch-gemma3.gguf"), GEMMA, None;
    greedy_generation_is_wired_end_to_end_for_phi3 =>
        Location::TestModels("arch-phi3.gguf"), PHI3, None;
    greedy_generation_is_wired_end_to_end_for_smollm3 =>
        Location::TestModels("arch-smollm3.gguf"), CHATML, None;
    greedy_generation_is_wired_end_to_end_for_qwen3moe =>
        Location::TestModels("arch-qwen3moe.gguf"), CHATML, None;
    greedy_generation_is_wired_end_to_end_for_hf_llama_directory =>
        Location::HfFixture("llama"), HF_CHATML, None;
    greedy_generation_is_wired_end_to_end_for_hf_gemma2_bf16_directory =>
        Location::HfFixture("gemma2-bf16"), HF_CHATML, None;
    greedy_generation_is_wired_end_to_end_for_hf_qwen2_sharded_directory =>
        Location::HfFixture("qwen2"), HF_CHATML, None;
}

/// A model whose own chat template takes tools (Qwen3's Hermes `<tool_call>`, Llama 3.1's bare
/// JSON call) is served them natively: the tools reach its template (their description is in the
/// prompt in the template's words), a forced call decodes in the template's syntax and comes
/// back through both APIs with arguments valid for the schema (random weights: only the grammar
/// makes them valid), and the call and its result render in the next turn.
async fn check_native_tools(name: &'static str, syntax: ToolSyntax, marker: &str) {
    let s = start(&Location::TestModels(name)).await;
    assert_eq!(s.svc.tool_syntax(), syntax, "{name}");
    let id = s.svc.model_id().to_owned();
    let schema = json!({"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": false});
    let tools =
        json!([{"name": "get_weather", "description": "Weather forecast", "input_schema": schema}]);
    let body = json!({"model": id, "max_tokens": 64, "messages": [{"role": "user", "content": "Weather?"}],
                      "tools": tools, "tool_choice": {"type": "tool", "name": "get_weather"}});
    let r = request(s.addr, "POST", "/v1/messages", Some(&body)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["stop_reason"], "tool_use", "{v}");
    let call = v["content"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["type"] == "tool_use")
        .unwrap();
    assert_eq!(call["name"], "get_weather");
    let input = call["input"].as_object().unwrap();
    assert!(
        input["city"].as_str().unwrap().chars().count() <= 12,
        "{call}"
    );
    assert!((1..=7).contains(&input["days"].as_u64().unwrap()), "{call}");
    let chat_tools =
        json!([{"type": "function", "function": {"name": "get_weather", "parameters": schema}}]);
    let body = json!({"model": id, "max_tokens": 64, "messages": [{"role": "user", "content": "Weather?"}],
                      "tools": chat_tools, "tool_choice": "required"});
    let r = request(s.addr, "POST", "/v1/chat/completions", Some(&body)).await;
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
    let args: Value = serde_json::from_str(
        v["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert!(args["city"].is_string() && args["days"].is_u64(), "{args}");
    // The next turn renders the tools, the call and its result through the model's template.
    let turns = vec![
        Msg::new(ChatRole::User, "Weather?"),
        Msg::new(ChatRole::Assistant, "").with_tool_calls(vec![ToolCallMessage::new(
            "call_1",
            "get_weather",
            args,
        )]),
        Msg::new(ChatRole::Tool, "sunny, 21 C").with_tool_result("call_1", "get_weather"),
    ];
    let spec = Tools::new(vec![
        ToolDefinition::new("get_weather", schema.clone()).with_description("Weather forecast"),
    ]);
    let with_tools = s
        .svc
        .count_tokens_with_tools(&Prompt::Chat(turns.clone()), Some(&spec))
        .unwrap();
    let without = s.svc.count_tokens(&Prompt::Chat(turns.clone())).unwrap();
    assert!(with_tools > without + 10, "{with_tools} vs {without}");
    let ids = s.svc.tokenize(&Prompt::Chat(turns)).unwrap();
    let text = s.svc.engine().tokenizer().unwrap().decode(&ids).unwrap();
    assert!(text.contains(marker), "{marker:?} not in {text:?}");
    assert!(text.contains("sunny, 21 C"), "{text:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qwen3s_template_takes_tools_natively_in_the_hermes_syntax_moe_model() {
    check_native_tools(
        "arch-qwen3moe.gguf",
        ToolSyntax::Hermes,
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\"",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llama31s_template_takes_tools_natively_as_a_json_call() {
    check_native_tools(
        "arch-llama3.gguf",
        ToolSyntax::Llama3Json,
        "{\"name\": \"get_weather\", \"parameters\": {\"city\"",
    )
    .await;
}

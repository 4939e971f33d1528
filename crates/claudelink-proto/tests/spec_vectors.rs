//! Checks the byte-exact test vectors of docs/claudelink.md: each `hex` block after a
//! `<!-- vector: NAME -->` marker must equal the encoding of the frame below, and decode to it.

use claudelink_proto::*;

fn vectors() -> Vec<(&'static str, Vec<u8>)> {
    let mut text_req = InferenceRequest::new("smollm2", Prompt::Text("Hi".into()), 16);
    text_req.sampling.temperature = Some(0.5);
    text_req.sampling.seed = Some(42);
    text_req.stop_sequences = vec!["\n".into()];
    let chat_req = {
        let mut r = InferenceRequest::new(
            "m",
            Prompt::Chat(vec![
                ChatMessage::new(ChatRole::System, "Be brief."),
                ChatMessage::new(ChatRole::User, "Hi"),
            ]),
            8,
        );
        r.cache_strategy = CacheStrategy::Adaptive;
        r.sampling.top_k = Some(40);
        r.priority = -1;
        r
    };
    let ids_req = InferenceRequest::new("m", Prompt::TokenIds(vec![1, 256, 49151]), 4);
    let enc = |f: Frame<'_>| f.to_vec().unwrap();
    vec![
        (
            "request-text",
            enc(Frame::Request(RequestFrame::from_request(&text_req, 65536))),
        ),
        (
            "request-chat",
            enc(Frame::Request(RequestFrame::from_request(&chat_req, 65536))),
        ),
        (
            "request-token-ids",
            enc(Frame::Request(RequestFrame::from_request(&ids_req, 65536))),
        ),
        (
            "started",
            enc(Frame::Started(StartedFrame {
                request_id: 4,
                input_tokens: 3,
            })),
        ),
        (
            "delta",
            enc(Frame::Delta(DeltaFrame {
                ids: TokenIds::from_slice(&[19556, 28]),
                text: "Hello,",
            })),
        ),
        (
            "finished",
            enc(Frame::Finished(FinishedFrame {
                stop_reason: StopReason::StopSequence,
                stop_sequence: Some("\n"),
                usage: Usage {
                    input_tokens: 3,
                    output_tokens: 7,
                },
            })),
        ),
        (
            "error",
            enc(Frame::Error(ErrorFrame {
                code: ErrorCode::Overloaded,
                retry_after_ms: 500,
                message: "busy",
            })),
        ),
        ("ping", enc(Frame::Ping(PingFrame { nonce: 1 }))),
        (
            "pong",
            enc(Frame::Pong(PongFrame {
                nonce: 1,
                health: Health {
                    ready: true,
                    queue_depth: 2,
                    running: 5,
                    active_streams: 9,
                },
            })),
        ),
        (
            "goaway",
            enc(Frame::GoAway(GoAwayFrame {
                code: Some(ErrorCode::Overloaded),
                last_stream_id: 8,
                retry_after_ms: 1000,
                message: "shed",
            })),
        ),
        ("auth", enc(Frame::Auth(AuthFrame { credential: "sk-1" }))),
    ]
}

fn hex(b: &[u8]) -> String {
    b.chunks(16)
        .map(|c| {
            c.iter()
                .map(|x| format!("{x:02x}"))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn doc_vectors() -> Vec<(String, Vec<u8>)> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/claudelink.md");
    let doc = std::fs::read_to_string(path).expect("docs/claudelink.md");
    let mut out = Vec::new();
    let mut lines = doc.lines();
    while let Some(l) = lines.next() {
        let Some(name) = l
            .trim()
            .strip_prefix("<!-- vector: ")
            .and_then(|r| r.strip_suffix(" -->"))
        else {
            continue;
        };
        assert_eq!(
            lines.next().map(str::trim),
            Some("```hex"),
            "vector {name}: hex block expected"
        );
        let mut bytes = Vec::new();
        for l in lines.by_ref() {
            if l.trim() == "```" {
                break;
            }
            for b in l.split_whitespace() {
                bytes.push(u8::from_str_radix(b, 16).unwrap());
            }
        }
        out.push((name.to_owned(), bytes));
    }
    out
}

#[test]
fn spec_vectors_match_the_codec() {
    let ours = vectors();
    if std::env::var_os("CLAUDELINK_PRINT_VECTORS").is_some() {
        for (n, b) in &ours {
            println!("<!-- vector: {n} -->\n```hex\n{}\n```\n", hex(b));
        }
    }
    let doc = doc_vectors();
    assert_eq!(doc.len(), ours.len(), "the spec must list every vector");
    for ((dn, db), (n, b)) in doc.iter().zip(&ours) {
        assert_eq!(dn, n);
        assert_eq!(
            db, b,
            "vector {n}: the spec's bytes differ from the encoder's"
        );
        let (frame, used) = decode_frame(db, DEFAULT_MAX_FRAME_SIZE).unwrap().unwrap();
        assert_eq!(used, db.len());
        assert_eq!(
            &frame.to_vec().unwrap(),
            db,
            "vector {n}: decode/encode round trip"
        );
    }
}

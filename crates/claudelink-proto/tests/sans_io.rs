//! Sans-IO tests: proptest round trips for every frame, decoder robustness, and deterministic
//! in-memory simulations of a client and a server stream/connection wired together.

use std::sync::Arc;
use std::time::{Duration, Instant};

use claudelink_proto::*;
use proptest::prelude::*;

fn role() -> impl Strategy<Value = ChatRole> {
    prop_oneof![
        Just(ChatRole::System),
        Just(ChatRole::User),
        Just(ChatRole::Assistant)
    ]
}

fn finite() -> impl Strategy<Value = f32> {
    -1.0e6f32..1.0e6
}

fn request() -> impl Strategy<Value = InferenceRequest> {
    let prompt = prop_oneof![
        ".{0,40}".prop_map(Prompt::Text),
        prop::collection::vec((role(), ".{0,20}"), 0..5).prop_map(|m| Prompt::Chat(
            m.into_iter()
                .map(|(role, content)| ChatMessage::new(role, content))
                .collect()
        )),
        prop::collection::vec(any::<u32>(), 0..64).prop_map(Prompt::TokenIds),
    ];
    (
        ".{0,16}",
        prompt,
        any::<u32>(),
        any::<i32>(),
        (
            proptest::option::of(finite()),
            proptest::option::of(finite()),
            proptest::option::of(any::<u32>()),
            proptest::option::of(finite()),
            proptest::option::of(finite()),
            proptest::option::of(any::<u64>()),
        ),
        prop::collection::vec(".{0,8}", 0..=16),
        any::<bool>(),
    )
        .prop_map(
            |(model, prompt, max_tokens, priority, s, stops, adaptive)| {
                let mut r = InferenceRequest::new(model, prompt, max_tokens);
                r.priority = priority;
                r.sampling.temperature = s.0;
                r.sampling.top_p = s.1;
                r.sampling.top_k = s.2;
                r.sampling.min_p = s.3;
                r.sampling.repetition_penalty = s.4;
                r.sampling.seed = s.5;
                r.stop_sequences = stops;
                r.cache_strategy = if adaptive {
                    CacheStrategy::Adaptive
                } else {
                    CacheStrategy::Deterministic
                };
                r
            },
        )
}

fn error_code() -> impl Strategy<Value = ErrorCode> {
    (1u16..=7).prop_map(|v| error_code_from_u16(v).unwrap())
}

fn event() -> impl Strategy<Value = InferenceEvent> {
    prop_oneof![
        any::<u32>().prop_map(|input_tokens| InferenceEvent::Started { input_tokens }),
        (prop::collection::vec(any::<u32>(), 0..16), ".{0,20}")
            .prop_map(|(ids, text)| InferenceEvent::Delta { ids, text }),
        (
            0u8..3,
            proptest::option::of(".{0,8}"),
            any::<u32>(),
            any::<u32>()
        )
            .prop_map(|(r, stop_sequence, i, o)| InferenceEvent::Finished {
                stop_reason: [
                    StopReason::EndTurn,
                    StopReason::MaxTokens,
                    StopReason::StopSequence
                ][r as usize],
                stop_sequence,
                usage: Usage {
                    input_tokens: i,
                    output_tokens: o
                },
            }),
        (error_code(), ".{0,20}")
            .prop_map(|(code, message)| InferenceEvent::Error { code, message }),
    ]
}

fn roundtrip(f: &Frame<'_>) {
    let bytes = f.to_vec().unwrap();
    let (back, used) = decode_frame(&bytes, HARD_MAX_FRAME_SIZE).unwrap().unwrap();
    assert_eq!(used, bytes.len());
    assert_eq!(&back, f);
    // Every strict prefix is "incomplete", never an error or a wrong frame.
    for cut in [0, 1, 4, 5, bytes.len() / 2, bytes.len() - 1] {
        if cut < bytes.len() {
            assert_eq!(
                decode_frame(&bytes[..cut], HARD_MAX_FRAME_SIZE).unwrap(),
                None
            );
        }
    }
}

proptest! {
    #[test]
    fn request_frames_round_trip(r in request(), sbs in any::<u32>()) {
        let f = Frame::Request(RequestFrame::from_request(&r, sbs));
        roundtrip(&f);
        let bytes = f.to_vec().unwrap();
        let (Frame::Request(back), _) = decode_frame(&bytes, HARD_MAX_FRAME_SIZE).unwrap().unwrap() else {
            panic!("not a request");
        };
        prop_assert_eq!(back.to_request(), r);
        prop_assert_eq!(back.stream_buffer_size, sbs);
    }

    #[test]
    fn response_frames_round_trip(ev in event(), id in any::<u64>()) {
        let f = Frame::from_event(&ev, id).unwrap();
        roundtrip(&f);
        prop_assert_eq!(f.to_event().unwrap(), ev);
    }

    #[test]
    fn error_frames_keep_retry_hint(code in error_code(), retry in any::<u32>(), msg in ".{0,30}") {
        roundtrip(&Frame::Error(ErrorFrame { code, retry_after_ms: retry, message: &msg }));
    }

    #[test]
    fn control_frames_round_trip(
        nonce in any::<u64>(), ready in any::<bool>(), q in any::<u32>(), r in any::<u32>(),
        a in any::<u32>(), code in proptest::option::of(error_code()), last in any::<u64>(),
        retry in any::<u32>(), msg in ".{0,30}",
    ) {
        roundtrip(&Frame::Ping(PingFrame { nonce }));
        roundtrip(&Frame::Pong(PongFrame {
            nonce, health: Health { ready, queue_depth: q, running: r, active_streams: a },
        }));
        roundtrip(&Frame::GoAway(GoAwayFrame { code, last_stream_id: last, retry_after_ms: retry, message: &msg }));
        roundtrip(&Frame::Auth(AuthFrame { credential: &msg }));
    }

    #[test]
    fn mutated_auth_frames_decode_or_error_cleanly(
        key in ".{0,40}", pos in any::<prop::sample::Index>(), val in any::<u8>(), cut in any::<prop::sample::Index>(),
    ) {
        let mut bytes = Frame::Auth(AuthFrame { credential: &key }).to_vec().unwrap();
        let i = pos.index(bytes.len());
        bytes[i] = val;
        let bytes = &bytes[..cut.index(bytes.len() + 1)];
        // Decodes (and then re-encodes to itself), is incomplete, or is an error: never a panic.
        if let Ok(Some((f, _))) = decode_frame(bytes, DEFAULT_MAX_FRAME_SIZE) {
            let again = f.to_vec().unwrap();
            prop_assert_eq!(decode_frame(&again, DEFAULT_MAX_FRAME_SIZE).unwrap().unwrap().0, f);
        }
    }

    #[test]
    fn only_a_listed_key_authenticates(
        keys in prop::collection::vec("[a-z0-9]{1,12}", 1..4), presented in "[a-z0-9]{0,12}",
    ) {
        let set = Arc::new(ApiKeys::new(keys.clone()));
        let t0 = Instant::now();
        let mut server = ConnectionState::new(Side::Server, DEFAULT_MAX_FRAME_SIZE, Duration::from_secs(5))
            .require_auth(set.clone(), t0 + Duration::from_secs(5));
        server.recv_control(&Frame::Auth(AuthFrame { credential: &presented }).to_vec().unwrap(), t0);
        match keys.iter().position(|k| *k == presented) {
            Some(i) => {
                prop_assert_eq!(
                    server.poll_action(),
                    Some(ConnectionAction::Authenticated { client: Some(set.label(i).to_owned()) })
                );
                prop_assert!(server.is_authenticated());
            }
            None => {
                prop_assert_eq!(server.poll_action(), Some(ConnectionAction::Close(AppErrorCode::Unauthenticated)));
                prop_assert!(!server.is_authenticated());
            }
        }
    }

    #[test]
    fn decoder_never_panics_on_garbage(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = decode_frame(&bytes, DEFAULT_MAX_FRAME_SIZE);
    }

    #[test]
    fn mutated_frames_decode_or_error_cleanly(r in request(), pos in any::<prop::sample::Index>(), val in any::<u8>()) {
        let mut bytes = Frame::Request(RequestFrame::from_request(&r, 1)).to_vec().unwrap();
        let i = pos.index(bytes.len());
        bytes[i] = val;
        if let Ok(Some((f, _))) = decode_frame(&bytes, HARD_MAX_FRAME_SIZE) {
            // Whatever decoded re-encodes to a frame that decodes to itself.
            let again = f.to_vec().unwrap();
            prop_assert_eq!(decode_frame(&again, HARD_MAX_FRAME_SIZE).unwrap().unwrap().0, f);
        }
    }
}

#[test]
fn token_ids_are_read_in_place() {
    let ids = [7u32, 0x0102_0304, u32::MAX];
    let bytes = Frame::Delta(DeltaFrame {
        ids: TokenIds::from_slice(&ids),
        text: "",
    })
    .to_vec()
    .unwrap();
    let (Frame::Delta(d), _) = decode_frame(&bytes, DEFAULT_MAX_FRAME_SIZE)
        .unwrap()
        .unwrap()
    else {
        panic!()
    };
    assert_eq!(d.ids.to_vec(), ids);
    assert_eq!(d.ids.get(1), Some(0x0102_0304));
    // The view points into the input buffer: no copy.
    let data_start = bytes.as_ptr() as usize + FRAME_HEADER_LEN + 4;
    if let Some(s) = d.ids.as_u32_slice() {
        assert_eq!(s.as_ptr() as usize, data_start);
    }
}

#[test]
fn oversize_and_unknown_frames_are_refused_from_the_header() {
    let huge = [0x01, 0xff, 0xff, 0xff, 0x7f];
    assert!(matches!(
        decode_frame(&huge, DEFAULT_MAX_FRAME_SIZE),
        Err(e @ FrameDecodeError::FrameTooLarge { len: 0x7fff_ffff, .. }) if e.app_code() == AppErrorCode::FrameTooLarge
    ));
    assert!(matches!(
        decode_frame(&[0x99, 0, 0, 0, 0], DEFAULT_MAX_FRAME_SIZE),
        Err(FrameDecodeError::UnknownFrameType { frame_type: 0x99 })
    ));
    // A count larger than the bytes present is rejected before allocating.
    let mut f = Frame::Delta(DeltaFrame {
        ids: TokenIds::from_slice(&[]),
        text: "",
    })
    .to_vec()
    .unwrap();
    f[5..9].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(
        decode_frame(&f, DEFAULT_MAX_FRAME_SIZE),
        Err(FrameDecodeError::Truncated { field: "ids", .. })
    ));
    // Trailing bytes inside a payload.
    let mut p = Frame::Ping(PingFrame { nonce: 1 }).to_vec().unwrap();
    p[1] = 9;
    p.push(0);
    assert!(matches!(
        decode_frame(&p, DEFAULT_MAX_FRAME_SIZE),
        Err(FrameDecodeError::TrailingBytes { extra: 1, .. })
    ));
}

/// Drives a client stream and a server stream against each other in memory, delivering bytes
/// in chunks of `chunk` to exercise reassembly.
fn simulate(
    req: &InferenceRequest,
    events: &[InferenceEvent],
    chunk: usize,
) -> Vec<InferenceEvent> {
    let wire = ClientStream::encode_request(req, 4096).unwrap();
    let mut server = ServerStream::new(4, DEFAULT_MAX_FRAME_SIZE);
    let mut client = ClientStream::new(DEFAULT_MAX_FRAME_SIZE);
    let n = wire.chunks(chunk).count();
    for (i, c) in wire.chunks(chunk).enumerate() {
        server.recv(c, i + 1 == n);
    }
    let mut to_client = Vec::new();
    let mut fin = false;
    let mut pending = events.iter();
    loop {
        match server.poll_action() {
            Some(ServerStreamAction::Submit {
                request,
                stream_buffer_size,
            }) => {
                assert_eq!(&request, req);
                assert_eq!(stream_buffer_size, 4096);
            }
            Some(ServerStreamAction::Send(b)) => to_client.extend(b),
            Some(ServerStreamAction::Finish) => fin = true,
            Some(other) => panic!("unexpected {other:?}"),
            None => match pending.next() {
                Some(ev) => server.event(ev),
                None => break,
            },
        }
    }
    assert!(fin && server.is_done());
    let n = to_client.chunks(chunk).count();
    let mut out = Vec::new();
    for (i, c) in to_client.chunks(chunk).enumerate() {
        client.recv(c, i + 1 == n).unwrap();
        while let Some(e) = client.poll_event() {
            out.push(e);
        }
    }
    assert_eq!(client.request_id(), Some(4));
    out
}

#[test]
fn simulated_request_delivers_every_event_in_order() {
    let req = InferenceRequest::new("m", Prompt::Text("hello".into()), 3);
    let events = vec![
        InferenceEvent::Started { input_tokens: 2 },
        InferenceEvent::Delta {
            ids: vec![1, 2],
            text: "ab".into(),
        },
        InferenceEvent::Delta {
            ids: vec![3],
            text: "".into(),
        },
        InferenceEvent::Finished {
            stop_reason: StopReason::MaxTokens,
            stop_sequence: None,
            usage: Usage {
                input_tokens: 2,
                output_tokens: 3,
            },
        },
    ];
    for chunk in [1, 2, 3, 7, 64, 4096] {
        assert_eq!(simulate(&req, &events, chunk), events);
    }
}

#[test]
fn server_stream_rejects_out_of_order_service_events_and_trailing_client_data() {
    let req = InferenceRequest::new("m", Prompt::Text("x".into()), 1);
    let wire = ClientStream::encode_request(&req, 1).unwrap();
    let mut s = ServerStream::new(0, DEFAULT_MAX_FRAME_SIZE);
    s.recv(&wire, false);
    assert!(matches!(
        s.poll_action(),
        Some(ServerStreamAction::Submit { .. })
    ));
    s.event(&InferenceEvent::Delta {
        ids: vec![],
        text: "x".into(),
    });
    assert_eq!(s.poll_action(), Some(ServerStreamAction::Cancel));
    assert!(matches!(s.poll_action(), Some(ServerStreamAction::Send(_))));
    assert_eq!(s.poll_action(), Some(ServerStreamAction::Finish));

    let mut s = ServerStream::new(0, DEFAULT_MAX_FRAME_SIZE);
    s.recv(&wire, false);
    let _ = s.poll_action();
    s.recv(&[1], false);
    assert_eq!(s.poll_action(), Some(ServerStreamAction::Cancel));
    assert_eq!(
        s.poll_action(),
        Some(ServerStreamAction::Abort(AppErrorCode::ProtocolError))
    );

    // Overload refusal carries the retry hint.
    let mut s = ServerStream::new(0, DEFAULT_MAX_FRAME_SIZE);
    s.recv(&wire, true);
    let _ = s.poll_action();
    s.submit_failed(&ServiceError::Overloaded { retry_after_ms: 77 });
    let Some(ServerStreamAction::Send(b)) = s.poll_action() else {
        panic!()
    };
    let (f, _) = decode_frame(&b, DEFAULT_MAX_FRAME_SIZE).unwrap().unwrap();
    assert_eq!(
        f,
        Frame::Error(ErrorFrame {
            code: ErrorCode::Overloaded,
            retry_after_ms: 77,
            message: "overloaded; retry after 77 ms"
        })
    );
}

#[test]
fn client_stream_rejects_bad_orders_and_truncation() {
    let started = Frame::Started(StartedFrame {
        request_id: 0,
        input_tokens: 1,
    })
    .to_vec()
    .unwrap();
    let delta = Frame::Delta(DeltaFrame {
        ids: TokenIds::from_slice(&[1]),
        text: "a",
    })
    .to_vec()
    .unwrap();
    let mut c = ClientStream::new(DEFAULT_MAX_FRAME_SIZE);
    assert!(matches!(
        c.recv(&delta, false),
        Err(ClientStreamError::UnexpectedFrame { .. })
    ));
    let mut c = ClientStream::new(DEFAULT_MAX_FRAME_SIZE);
    c.recv(&started, false).unwrap();
    assert_eq!(c.recv(&delta, true), Err(ClientStreamError::Truncated));
}

#[test]
fn simulated_connection_ping_goaway_and_timeouts() {
    let t0 = Instant::now();
    let mut client =
        ConnectionState::new(Side::Client, DEFAULT_MAX_FRAME_SIZE, Duration::from_secs(5));
    let mut server =
        ConnectionState::new(Side::Server, DEFAULT_MAX_FRAME_SIZE, Duration::from_secs(5));
    let pipe = |from: &mut ConnectionState, to: &mut ConnectionState, now| {
        while let Some(a) = from.poll_action() {
            match a {
                ConnectionAction::SendControl(b) => {
                    // Deliver one byte at a time.
                    for x in b {
                        to.recv_control(&[x], now);
                    }
                }
                other => panic!("unexpected {other:?}"),
            }
        }
    };
    let nonce = client.send_ping(t0);
    pipe(&mut client, &mut server, t0);
    assert_eq!(
        server.poll_action(),
        Some(ConnectionAction::PingReceived { nonce })
    );
    let h = Health {
        ready: true,
        queue_depth: 1,
        running: 2,
        active_streams: 3,
    };
    server.send_pong(nonce, h);
    let t1 = t0 + Duration::from_millis(3);
    pipe(&mut server, &mut client, t1);
    assert_eq!(
        client.poll_action(),
        Some(ConnectionAction::PongReceived {
            nonce,
            rtt: Duration::from_millis(3),
            health: h
        })
    );

    // GOAWAY: the server refuses later streams; the client learns it is draining.
    assert!(server.accept_stream(12));
    server.send_goaway(Some(ErrorCode::Overloaded), 8, 100, "shed");
    assert!(server.accept_stream(8) && !server.accept_stream(12));
    pipe(&mut server, &mut client, t1);
    assert!(matches!(
        client.poll_action(),
        Some(ConnectionAction::GoAwayReceived {
            last_stream_id: 8,
            ..
        })
    ));
    assert!(client.is_draining());

    // An unanswered ping times out.
    let n2 = client.send_ping(t1);
    let _ = client.poll_action();
    assert_eq!(client.poll_timeout(), Some(t1 + Duration::from_secs(5)));
    client.handle_timeout(t1 + Duration::from_secs(4));
    assert_eq!(client.poll_action(), None);
    client.handle_timeout(t1 + Duration::from_secs(5));
    assert_eq!(
        client.poll_action(),
        Some(ConnectionAction::PingTimedOut { nonce: n2 })
    );

    // A server that raises last_stream_id in a later GOAWAY breaks the protocol.
    client.recv_control(
        &Frame::GoAway(GoAwayFrame {
            code: None,
            last_stream_id: 100,
            retry_after_ms: 0,
            message: "",
        })
        .to_vec()
        .unwrap(),
        t1,
    );
    assert_eq!(
        client.poll_action(),
        Some(ConnectionAction::Close(AppErrorCode::ProtocolError))
    );

    // A request frame on the control stream closes the connection.
    let mut s = ConnectionState::new(Side::Server, DEFAULT_MAX_FRAME_SIZE, Duration::from_secs(5));
    s.recv_control(
        &Frame::Started(StartedFrame {
            request_id: 0,
            input_tokens: 0,
        })
        .to_vec()
        .unwrap(),
        t0,
    );
    assert_eq!(
        s.poll_action(),
        Some(ConnectionAction::Close(AppErrorCode::ProtocolError))
    );
}

fn keyed_server(t0: Instant) -> (ConnectionState, Arc<ApiKeys>) {
    let keys = Arc::new(ApiKeys::new(["sk-a".to_string(), "sk-b".to_string()]));
    let s = ConnectionState::new(Side::Server, DEFAULT_MAX_FRAME_SIZE, Duration::from_secs(5))
        .require_auth(keys.clone(), t0 + Duration::from_secs(5));
    (s, keys)
}

fn control(frames: &[Frame<'_>]) -> Vec<u8> {
    frames.iter().flat_map(|f| f.to_vec().unwrap()).collect()
}

#[test]
fn auth_first_then_control_traffic_flows_and_the_label_is_kept() {
    let t0 = Instant::now();
    let (mut server, keys) = keyed_server(t0);
    assert!(!server.is_authenticated());
    assert_eq!(server.poll_timeout(), Some(t0 + Duration::from_secs(5)));
    let mut client =
        ConnectionState::new(Side::Client, DEFAULT_MAX_FRAME_SIZE, Duration::from_secs(5));
    client.send_auth("sk-b");
    let nonce = client.send_ping(t0);
    // AUTH and PING in one write, delivered a byte at a time.
    let mut bytes = Vec::new();
    while let Some(ConnectionAction::SendControl(b)) = client.poll_action() {
        bytes.extend(b);
    }
    for b in bytes {
        server.recv_control(&[b], t0);
    }
    assert_eq!(
        server.poll_action(),
        Some(ConnectionAction::Authenticated {
            client: Some(keys.label(1).to_owned())
        })
    );
    assert_eq!(
        server.poll_action(),
        Some(ConnectionAction::PingReceived { nonce })
    );
    assert!(server.is_authenticated());
    assert_eq!(server.client_label(), Some(keys.label(1)));
    // The AUTH deadline no longer applies.
    assert_eq!(server.poll_timeout(), None);
    server.handle_timeout(t0 + Duration::from_secs(60));
    assert_eq!(server.poll_action(), None);
    // A second AUTH is a protocol violation.
    server.recv_control(
        &control(&[Frame::Auth(AuthFrame { credential: "sk-b" })]),
        t0,
    );
    assert_eq!(
        server.poll_action(),
        Some(ConnectionAction::Close(AppErrorCode::ProtocolError))
    );
}

#[test]
fn missing_wrong_or_misplaced_auth_closes_unauthenticated() {
    let t0 = Instant::now();
    let unauth = Some(ConnectionAction::Close(AppErrorCode::Unauthenticated));
    // Wrong key.
    let (mut s, _) = keyed_server(t0);
    s.recv_control(
        &control(&[Frame::Auth(AuthFrame { credential: "sk-c" })]),
        t0,
    );
    assert_eq!(s.poll_action(), unauth);
    assert!(s.is_closed() && !s.is_authenticated());
    // Anything else first, even with the right key after it: nothing after it is looked at.
    let (mut s, _) = keyed_server(t0);
    s.recv_control(
        &control(&[
            Frame::Ping(PingFrame { nonce: 1 }),
            Frame::Auth(AuthFrame { credential: "sk-a" }),
        ]),
        t0,
    );
    assert_eq!(s.poll_action(), unauth);
    assert_eq!(s.poll_action(), None);
    let r = InferenceRequest::new("m", Prompt::Text("x".into()), 1);
    let (mut s, _) = keyed_server(t0);
    s.recv_control(
        &control(&[Frame::Request(RequestFrame::from_request(&r, 1))]),
        t0,
    );
    assert_eq!(s.poll_action(), unauth);
    // Nothing within the deadline.
    let (mut s, _) = keyed_server(t0);
    s.handle_timeout(t0 + Duration::from_millis(4999));
    assert_eq!(s.poll_action(), None);
    s.handle_timeout(t0 + Duration::from_secs(5));
    assert_eq!(s.poll_action(), unauth);
    assert_eq!(s.poll_timeout(), None);
    // AUTH after the deadline is not looked at.
    s.recv_control(
        &control(&[Frame::Auth(AuthFrame { credential: "sk-a" })]),
        t0,
    );
    assert_eq!(s.poll_action(), None);
    assert!(!s.is_authenticated());
}

#[test]
fn a_server_without_keys_takes_auth_or_none_and_clients_refuse_auth() {
    let t0 = Instant::now();
    // No keys (or an empty key set): open, AUTH accepted and ignored.
    let mut s = ConnectionState::new(Side::Server, DEFAULT_MAX_FRAME_SIZE, Duration::from_secs(5))
        .require_auth(Arc::new(ApiKeys::default()), t0);
    assert!(s.is_authenticated());
    s.handle_timeout(t0 + Duration::from_secs(10));
    assert_eq!(s.poll_action(), None);
    s.recv_control(&control(&[Frame::Auth(AuthFrame { credential: "x" })]), t0);
    assert_eq!(
        s.poll_action(),
        Some(ConnectionAction::Authenticated { client: None })
    );
    assert_eq!(s.client_label(), None);
    // A client receiving AUTH: wrong direction.
    let mut c = ConnectionState::new(Side::Client, DEFAULT_MAX_FRAME_SIZE, Duration::from_secs(5));
    c.recv_control(&control(&[Frame::Auth(AuthFrame { credential: "x" })]), t0);
    assert_eq!(
        c.poll_action(),
        Some(ConnectionAction::Close(AppErrorCode::ProtocolError))
    );
}

#[test]
fn server_stream_rejects_unknown_models_and_ends_with_shutting_down() {
    let r = InferenceRequest::new("m", Prompt::Text("x".into()), 1);
    let bytes = Frame::Request(RequestFrame::from_request(&r, 1))
        .to_vec()
        .unwrap();
    let decode_error = |b: &[u8]| match decode_frame(b, DEFAULT_MAX_FRAME_SIZE) {
        Ok(Some((Frame::Error(e), _))) => (e.code, e.message.to_owned()),
        other => panic!("expected ERROR, got {other:?}"),
    };
    // Rejected before submission: ERROR not_found, FIN, no Cancel (nothing was running).
    let mut s = ServerStream::new(0, DEFAULT_MAX_FRAME_SIZE);
    s.recv(&bytes, true);
    assert!(matches!(
        s.poll_action(),
        Some(ServerStreamAction::Submit { .. })
    ));
    s.reject(ErrorCode::NotFound, "model: m is not served here");
    let Some(ServerStreamAction::Send(b)) = s.poll_action() else {
        panic!("no ERROR frame")
    };
    assert_eq!(decode_error(&b).0, ErrorCode::NotFound);
    assert_eq!(s.poll_action(), Some(ServerStreamAction::Finish));
    assert!(s.is_done());
    // Shutting down while running: cancel the work, then ERROR shutting_down and FIN.
    let mut s = ServerStream::new(0, DEFAULT_MAX_FRAME_SIZE);
    s.recv(&bytes, true);
    let _ = s.poll_action();
    s.event(&InferenceEvent::Started { input_tokens: 1 });
    let _ = s.poll_action();
    s.shutting_down();
    assert_eq!(s.poll_action(), Some(ServerStreamAction::Cancel));
    let Some(ServerStreamAction::Send(b)) = s.poll_action() else {
        panic!("no ERROR frame")
    };
    assert_eq!(decode_error(&b).0, ErrorCode::ShuttingDown);
    assert_eq!(s.poll_action(), Some(ServerStreamAction::Finish));
    // Later events are ignored; a second shutdown does nothing.
    s.event(&InferenceEvent::Delta {
        ids: vec![1],
        text: "a".into(),
    });
    s.shutting_down();
    assert_eq!(s.poll_action(), None);
    // Still reading its REQUEST: refused (not processed).
    let mut s = ServerStream::new(0, DEFAULT_MAX_FRAME_SIZE);
    s.recv(&bytes[..3], false);
    s.shutting_down();
    assert_eq!(
        s.poll_action(),
        Some(ServerStreamAction::Abort(AppErrorCode::Refused))
    );
}

#[test]
fn penalties_claudelink_does_not_carry_are_refused_not_dropped() {
    let mut r = InferenceRequest::new("m", Prompt::Text("hi".into()), 4);
    r.sampling.presence_penalty = Some(0.5);
    let err = Frame::Request(RequestFrame::from_request(&r, 1))
        .to_vec()
        .unwrap_err();
    assert_eq!(
        err,
        EncodeError::NotCarried {
            field: "presence_penalty"
        }
    );
    r.sampling.presence_penalty = None;
    r.sampling.frequency_penalty = Some(0.5);
    assert!(matches!(
        Frame::Request(RequestFrame::from_request(&r, 1)).to_vec(),
        Err(EncodeError::NotCarried {
            field: "frequency_penalty"
        })
    ));
    r.sampling.frequency_penalty = None;
    assert!(
        Frame::Request(RequestFrame::from_request(&r, 1))
            .to_vec()
            .is_ok()
    );
    // An output format is not carried either: the client refuses to send it.
    r.output_format = Some(Arc::new(OutputFormat::Regex("[0-9]+".into())));
    assert_eq!(
        ClientStream::encode_request(&r, 1),
        Err(EncodeError::NotCarried {
            field: "output_format"
        })
    );
}

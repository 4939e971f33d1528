//! Fuzzes the claudelink frame decoder and the sans-IO state machines that consume it.
#![no_main]

use std::sync::Arc;
use std::time::{Duration, Instant};

use claudelink_proto::{
    ApiKeys, ClientStream, ConnectionState, DEFAULT_MAX_FRAME_SIZE, ServerStream, Side,
    decode_frame,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Decode every frame in the input; each decoded frame must re-encode to itself.
    let mut rest = data;
    while let Ok(Some((frame, used))) = decode_frame(rest, DEFAULT_MAX_FRAME_SIZE) {
        let again = frame.to_vec().expect("a decoded frame re-encodes");
        let (back, n) = decode_frame(&again, DEFAULT_MAX_FRAME_SIZE)
            .expect("re-encoded frame decodes")
            .expect("complete");
        assert_eq!(n, again.len());
        assert_eq!(back, frame);
        rest = &rest[used..];
    }
    // The state machines take arbitrary bytes split at an input-chosen point.
    let split = data.first().map_or(0, |b| *b as usize).min(data.len());
    let (a, b) = data.split_at(split);
    let mut server = ServerStream::new(0, DEFAULT_MAX_FRAME_SIZE);
    server.recv(a, false);
    server.recv(b, true);
    server.shutting_down();
    while server.poll_action().is_some() {}
    let mut client = ClientStream::new(DEFAULT_MAX_FRAME_SIZE);
    if client.recv(a, false).is_ok() {
        let _ = client.recv(b, true);
    }
    while client.poll_event().is_some() {}
    let now = Instant::now();
    // A server requiring AUTH (whose key is the input's first bytes, so that valid AUTH frames
    // are reachable) as well as an open server and a client.
    let key = String::from_utf8_lossy(&data[..data.len().min(8)]).into_owned();
    let keys = Arc::new(ApiKeys::new([key]));
    let keyed = ConnectionState::new(Side::Server, DEFAULT_MAX_FRAME_SIZE, Duration::from_secs(1))
        .require_auth(keys, now + Duration::from_secs(1));
    let plain = |side| ConnectionState::new(side, DEFAULT_MAX_FRAME_SIZE, Duration::from_secs(1));
    for mut conn in [plain(Side::Client), plain(Side::Server), keyed] {
        conn.recv_control(a, now);
        conn.recv_control(b, now);
        conn.handle_timeout(now + Duration::from_secs(2));
        while conn.poll_action().is_some() {}
    }
});

//! Pieces shared by the root crate's integration tests.
#![allow(dead_code, unreachable_pub)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;

use serde_json::Value;
use zerolayer::EngineService;
use zerolayer::zerolayer_gateway::{Gateway, GatewayConfig};

/// A gateway over `svc` on a loopback port, on a runtime (2 workers) of its own thread, for the
/// rest of the test process; any model name is accepted.
pub fn serve(svc: EngineService) -> SocketAddr {
    let gateway = Gateway::new(
        Arc::new(svc),
        GatewayConfig::default().accept_any_model(true),
    );
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    listener.set_nonblocking(true).unwrap();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            let _ = gateway.serve_tcp(listener, std::future::pending()).await;
        });
    });
    addr
}

/// One HTTP/1.1 request (a JSON body when given); the status and the JSON answer.
pub fn http_json(addr: SocketAddr, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
    let body = body.map(Value::to_string).unwrap_or_default();
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let (head, body) = resp.split_once("\r\n\r\n").unwrap();
    let status = head[9..12].parse().unwrap();
    let v = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {head}\n{body}"));
    (status, v)
}

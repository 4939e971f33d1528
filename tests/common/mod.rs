//! Pieces shared by the root crate's integration tests.
#![allow(dead_code, unreachable_pub)]

use std::net::SocketAddr;
use std::sync::Arc;

use zerolayer::EngineService;
use zerolayer::claudelink_proto::{Gateway, GatewayConfig};

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

//! Asks a server which model it serves (`GET /v1/models` over HTTP/1.1): the clients' default
//! for `--model`. Shared by the examples with `#[path = "common/served_model.rs"] mod ...;`.

use std::net::SocketAddr;

use anyhow::Context as _;
use bytes::Bytes;
use http_body_util::{BodyExt as _, Empty};

/// The id of the first model `GET http://{addr}/v1/models` lists (`api_key` sent as `x-api-key`).
pub(crate) async fn served_model(
    addr: SocketAddr,
    api_key: Option<&str>,
) -> anyhow::Result<String> {
    let io = hyper_util::rt::TokioIo::new(
        tokio::net::TcpStream::connect(addr)
            .await
            .with_context(|| format!("connecting to {addr} to ask GET /v1/models"))?,
    );
    let (mut send, conn) = hyper::client::conn::http1::handshake(io).await?;
    tokio::spawn(conn);
    let mut req = http::Request::get("/v1/models").header(http::header::HOST, addr.to_string());
    if let Some(k) = api_key {
        req = req.header("x-api-key", k);
    }
    let resp = send.send_request(req.body(Empty::<Bytes>::new())?).await?;
    let status = resp.status();
    let body = resp.into_body().collect().await?.to_bytes();
    anyhow::ensure!(
        status.is_success(),
        "GET /v1/models on {addr}: {status} {}",
        String::from_utf8_lossy(&body)
    );
    let v: serde_json::Value = serde_json::from_slice(&body).context("GET /v1/models: JSON")?;
    v["data"][0]["id"]
        .as_str()
        .map(str::to_owned)
        .with_context(|| format!("GET /v1/models on {addr} lists no model: {v}"))
}

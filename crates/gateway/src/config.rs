//! Gateway configuration.

use std::time::Duration;

use bytes::Bytes;

/// The layer/protocol version sent in every `x-claude-layer` header.
pub const LAYER_VERSION: &str = "v2.1.0-alpha";

/// How the gateway behaves: limits, keys, advertised HTTP/3 port.
///
/// ```
/// use std::time::Duration;
/// use zerolayer_gateway::GatewayConfig;
///
/// let config = GatewayConfig::default()
///     .api_keys(["sk-local-1".to_string()])
///     .max_body_bytes(1 << 20)
///     .request_timeout(Duration::from_secs(120))
///     .h3_port(Some(8443))
///     .max_prompt_bytes(1 << 20)
///     .metrics_key(Some("sk-metrics".to_string()))
///     .max_connections_per_ip(64);
/// assert_eq!(config.max_body_bytes, 1 << 20);
/// assert_eq!(config.max_connections_per_ip, 64);
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct GatewayConfig {
    /// Accepted API keys (`x-api-key` or `Authorization: Bearer`). Empty: the gateway is open.
    pub api_keys: Vec<String>,
    /// Largest accepted request body; bigger bodies get 413 `request_too_large`.
    pub max_body_bytes: usize,
    /// Largest accepted prompt in tokens (on top of the service's own context check).
    pub max_prompt_tokens: Option<u32>,
    /// Largest accepted `max_tokens`.
    pub max_output_tokens: u32,
    /// `max_tokens` used by Chat Completions requests that do not send one.
    pub default_chat_max_tokens: u32,
    /// Wall-clock limit for one request, from its headers to its last byte.
    pub request_timeout: Duration,
    /// Limit for receiving a request body.
    pub body_timeout: Duration,
    /// Generation requests in flight before new ones get 529 `overloaded_error` (0: no limit).
    pub max_concurrent_requests: usize,
    /// Generation requests in flight per API key before 429 `rate_limit_error` (0: no limit).
    pub max_concurrent_per_key: usize,
    /// `retry-after-ms` sent with 429 and 529 responses the gateway itself decides.
    pub retry_after_ms: u64,
    /// UDP port on which HTTP/3 is served, advertised with `Alt-Svc` on TCP responses.
    pub h3_port: Option<u16>,
    /// Serve requests naming an unknown model with the first served model instead of 404.
    pub accept_any_model: bool,
    /// Largest accepted prompt in bytes (the text of every message and the system prompt);
    /// bigger prompts get 413 `request_too_large` before any tokenization. Default 4 MiB.
    pub max_prompt_bytes: usize,
    /// Key required by `GET /metrics` (as `x-api-key` or `Authorization: Bearer`); `None`:
    /// `/metrics` is open.
    pub metrics_key: Option<String>,
    /// How long a TCP client may take to send a request's headers (HTTP/1.1) or its first
    /// bytes (HTTP/2 preface) before the connection is closed. Default 10 s.
    pub header_read_timeout: Duration,
    /// A connection with no request open for this long is closed, on every transport
    /// (HTTP/1.1 keep-alive, HTTP/2 and HTTP/3: PINGs and other frames do not count as
    /// activity). Default 10 s.
    pub idle_timeout: Duration,
    /// With API keys: a connection that has not presented a valid key this long after it
    /// opened is closed (on every transport), and until then it counts against the smaller
    /// unauthenticated connection budget (a quarter of `max_connections_per_ip`, half of
    /// `max_connections`). Default 5 s.
    pub auth_timeout: Duration,
    /// HTTP/2 keep-alive: a PING is sent after this much silence and the connection is closed
    /// when it is not answered within the same time. Default 20 s.
    pub http2_keep_alive: Duration,
    /// TCP keep-alive idle time; with `tcp_user_timeout` it bounds how long a vanished peer's
    /// connection (and generation) lives. Default 10 s.
    pub tcp_keepalive: Duration,
    /// `TCP_USER_TIMEOUT` (Linux): unacknowledged sent data for this long closes the
    /// connection. Default 20 s.
    pub tcp_user_timeout: Duration,
    /// Open TCP connections per listener; beyond them new connections get a minimal `503` and
    /// are closed (0: no limit). Default 4096.
    pub max_connections: usize,
    /// Open TCP connections per client IP address; beyond them new connections from that
    /// address get a minimal `503` and are closed (0: no limit). Default 256.
    pub max_connections_per_ip: usize,
    /// Tokenizations (`count_tokens`) and large-body parses running at once on the blocking
    /// pool; more wait for a turn (0: the number of CPUs).
    pub blocking_tasks: usize,
    /// HTML page answered to `GET /` (`None`: 404), e.g. a chat client of the API. Served
    /// without authentication (a browser loads it before any key is entered) under a
    /// Content-Security-Policy that allows inline script and style and requests to this
    /// origin only.
    pub index_page: Option<Bytes>,
    /// Host names a server without API keys answers besides loopback names (`localhost`,
    /// `*.localhost`) and IP addresses (matched without case or port; a request naming
    /// another host gets 403, against DNS rebinding; `/health` is exempt). Ignored when API
    /// keys are configured. Default: none.
    pub allowed_hosts: Vec<String>,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            api_keys: Vec::new(),
            max_body_bytes: 32 * 1024 * 1024,
            max_prompt_tokens: None,
            max_output_tokens: 1 << 20,
            default_chat_max_tokens: 1024,
            request_timeout: Duration::from_secs(600),
            body_timeout: Duration::from_secs(30),
            max_concurrent_requests: 0,
            max_concurrent_per_key: 0,
            retry_after_ms: 1000,
            h3_port: None,
            accept_any_model: false,
            max_prompt_bytes: 4 * 1024 * 1024,
            metrics_key: None,
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(10),
            auth_timeout: Duration::from_secs(5),
            http2_keep_alive: Duration::from_secs(20),
            tcp_keepalive: Duration::from_secs(10),
            tcp_user_timeout: Duration::from_secs(20),
            max_connections: 4096,
            max_connections_per_ip: 256,
            blocking_tasks: 0,
            index_page: None,
            allowed_hosts: Vec::new(),
        }
    }
}

impl GatewayConfig {
    /// Sets the accepted API keys (empty: open gateway).
    pub fn api_keys(mut self, keys: impl IntoIterator<Item = String>) -> Self {
        self.api_keys = keys.into_iter().filter(|k| !k.is_empty()).collect();
        self
    }
    /// Sets the largest accepted request body.
    pub fn max_body_bytes(mut self, bytes: usize) -> Self {
        self.max_body_bytes = bytes;
        self
    }
    /// Sets the largest accepted prompt in tokens.
    pub fn max_prompt_tokens(mut self, tokens: Option<u32>) -> Self {
        self.max_prompt_tokens = tokens;
        self
    }
    /// Sets the largest accepted `max_tokens`.
    pub fn max_output_tokens(mut self, tokens: u32) -> Self {
        self.max_output_tokens = tokens;
        self
    }
    /// Sets the `max_tokens` of Chat Completions requests that do not send one.
    pub fn default_chat_max_tokens(mut self, tokens: u32) -> Self {
        self.default_chat_max_tokens = tokens;
        self
    }
    /// Sets the per-request wall-clock limit.
    pub fn request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }
    /// Sets the limit for receiving a request body.
    pub fn body_timeout(mut self, timeout: Duration) -> Self {
        self.body_timeout = timeout;
        self
    }
    /// Sets the number of generation requests in flight before 529 (0: no limit).
    pub fn max_concurrent_requests(mut self, n: usize) -> Self {
        self.max_concurrent_requests = n;
        self
    }
    /// Sets the number of generation requests in flight per key before 429 (0: no limit).
    pub fn max_concurrent_per_key(mut self, n: usize) -> Self {
        self.max_concurrent_per_key = n;
        self
    }
    /// Sets the `retry-after-ms` hint of gateway-decided 429/529 responses.
    pub fn retry_after_ms(mut self, ms: u64) -> Self {
        self.retry_after_ms = ms;
        self
    }
    /// Sets the UDP port advertised in `Alt-Svc: h3=":PORT"` (None: no `Alt-Svc`).
    pub fn h3_port(mut self, port: Option<u16>) -> Self {
        self.h3_port = port;
        self
    }
    /// Serve unknown model names with the first served model instead of answering 404.
    pub fn accept_any_model(mut self, yes: bool) -> Self {
        self.accept_any_model = yes;
        self
    }
    /// Sets the largest accepted prompt in bytes (413 `request_too_large` beyond it).
    pub fn max_prompt_bytes(mut self, bytes: usize) -> Self {
        self.max_prompt_bytes = bytes;
        self
    }
    /// Sets the key `/metrics` requires (`None` or empty: `/metrics` is open).
    pub fn metrics_key(mut self, key: Option<String>) -> Self {
        self.metrics_key = key.filter(|k| !k.is_empty());
        self
    }
    /// Sets the time a TCP client has to send its request headers.
    pub fn header_read_timeout(mut self, timeout: Duration) -> Self {
        self.header_read_timeout = timeout;
        self
    }
    /// Sets how long a connection may stay open with no request (see
    /// [`GatewayConfig::idle_timeout`]).
    ///
    /// ```
    /// use std::time::Duration;
    /// use zerolayer_gateway::GatewayConfig;
    /// let cfg = GatewayConfig::default()
    ///     .idle_timeout(Duration::from_secs(30))
    ///     .auth_timeout(Duration::from_secs(2));
    /// assert_eq!((cfg.idle_timeout.as_secs(), cfg.auth_timeout.as_secs()), (30, 2));
    /// ```
    pub fn idle_timeout(mut self, timeout: Duration) -> Self {
        self.idle_timeout = timeout;
        self
    }
    /// Sets how long a connection may stay open without presenting a valid key (see
    /// [`GatewayConfig::auth_timeout`]).
    pub fn auth_timeout(mut self, timeout: Duration) -> Self {
        self.auth_timeout = timeout;
        self
    }
    /// Sets the HTTP/2 keep-alive interval (and PING answer timeout).
    pub fn http2_keep_alive(mut self, every: Duration) -> Self {
        self.http2_keep_alive = every;
        self
    }
    /// Sets the TCP keep-alive idle time.
    pub fn tcp_keepalive(mut self, idle: Duration) -> Self {
        self.tcp_keepalive = idle;
        self
    }
    /// Sets `TCP_USER_TIMEOUT` (Linux only; ignored elsewhere).
    pub fn tcp_user_timeout(mut self, timeout: Duration) -> Self {
        self.tcp_user_timeout = timeout;
        self
    }
    /// Sets the open TCP connections allowed per listener (0: no limit).
    pub fn max_connections(mut self, n: usize) -> Self {
        self.max_connections = n;
        self
    }
    /// Sets the open TCP connections allowed per client IP address (0: no limit).
    pub fn max_connections_per_ip(mut self, n: usize) -> Self {
        self.max_connections_per_ip = n;
        self
    }
    /// Sets how many tokenizations run at once on the blocking pool (0: the number of CPUs).
    pub fn blocking_tasks(mut self, n: usize) -> Self {
        self.blocking_tasks = n;
        self
    }

    /// Sets the page answered to `GET /` (`None`: 404).
    ///
    /// ```
    /// use zerolayer_gateway::GatewayConfig;
    /// let cfg = GatewayConfig::default().index_page(Some("<!doctype html><title>chat</title>"));
    /// assert!(cfg.index_page.is_some());
    /// ```
    pub fn index_page(mut self, page: Option<&'static str>) -> Self {
        self.index_page = page.map(|p| Bytes::from_static(p.as_bytes()));
        self
    }

    /// Sets the host names a server without API keys answers besides loopback names and IP
    /// addresses (e.g. the machine's LAN name, or the name a reverse proxy forwards).
    ///
    /// ```
    /// use zerolayer_gateway::GatewayConfig;
    /// let cfg = GatewayConfig::default().allowed_hosts(["gpu-box.lan".to_string()]);
    /// assert_eq!(cfg.allowed_hosts, ["gpu-box.lan"]);
    /// ```
    pub fn allowed_hosts(mut self, names: impl IntoIterator<Item = String>) -> Self {
        self.allowed_hosts = names.into_iter().filter(|n| !n.is_empty()).collect();
        self
    }
}

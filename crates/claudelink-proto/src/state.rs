//! Sans-IO state machines: no sockets, no async, no clocks. Each takes inputs (bytes received,
//! service events, the current time) and queues actions for the I/O shell to carry out, in the
//! spirit of `quinn-proto`.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::auth::ApiKeys;
use crate::codec::{
    AppErrorCode, AuthFrame, ErrorFrame, FRAME_HEADER_LEN, Frame, FrameDecodeError, FrameType,
    GoAwayFrame, Health, PingFrame, PongFrame, RequestFrame, decode_frame,
};
use zerolayer_api::{ErrorCode, InferenceEvent, InferenceRequest, Prompt, ServiceError};

/// What the server shell must do for one request stream.
#[derive(Debug, PartialEq)]
#[non_exhaustive]
pub enum ServerStreamAction {
    /// Hand the request to the service.
    Submit {
        /// The decoded request.
        request: InferenceRequest,
        /// Bytes the client allows the server to buffer ahead on this stream.
        stream_buffer_size: u32,
    },
    /// Write these bytes to the stream.
    Send(Vec<u8>),
    /// Finish (FIN) the send side.
    Finish,
    /// Reset the send side and stop the receive side with this code; drop any service work.
    Abort(AppErrorCode),
    /// Drop the service's event stream (the request is cancelled).
    Cancel,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ServerPhase {
    ReadingRequest,
    Running { started: bool },
    Done,
}

/// Server side of one request stream.
///
/// ```
/// use claudelink_proto::*;
/// let req = InferenceRequest::new("m", Prompt::Text("hi".into()), 4);
/// let bytes = Frame::Request(RequestFrame::from_request(&req, 65536)).to_vec().unwrap();
/// let mut s = ServerStream::new(0, DEFAULT_MAX_FRAME_SIZE);
/// s.recv(&bytes, true);
/// assert!(matches!(s.poll_action(), Some(ServerStreamAction::Submit { .. })));
/// ```
#[derive(Debug)]
pub struct ServerStream {
    request_id: u64,
    max_frame_size: u32,
    buf: Vec<u8>,
    phase: ServerPhase,
    actions: VecDeque<ServerStreamAction>,
}

impl ServerStream {
    /// A stream awaiting its REQUEST frame; `request_id` goes into STARTED.
    pub fn new(request_id: u64, max_frame_size: u32) -> Self {
        Self {
            request_id,
            max_frame_size,
            buf: Vec::new(),
            phase: ServerPhase::ReadingRequest,
            actions: VecDeque::new(),
        }
    }

    /// Bytes buffered while waiting for the rest of the REQUEST frame.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// Whether the stream is finished (nothing more will be sent).
    pub fn is_done(&self) -> bool {
        self.phase == ServerPhase::Done
    }

    /// Whether the request was submitted and the service's events are awaited.
    pub fn is_running(&self) -> bool {
        matches!(self.phase, ServerPhase::Running { .. })
    }

    /// The next action, in order.
    pub fn poll_action(&mut self) -> Option<ServerStreamAction> {
        self.actions.pop_front()
    }

    fn abort(&mut self, code: AppErrorCode) {
        if self.phase == ServerPhase::Done {
            return;
        }
        if self.is_running() {
            self.actions.push_back(ServerStreamAction::Cancel);
        }
        self.actions.push_back(ServerStreamAction::Abort(code));
        self.phase = ServerPhase::Done;
        self.buf = Vec::new();
    }

    /// Data from the client; `fin` when the client finished its send side.
    pub fn recv(&mut self, data: &[u8], fin: bool) {
        match self.phase {
            ServerPhase::Done => return,
            ServerPhase::Running { .. } => {
                // The client sends exactly one frame; anything after it is a violation.
                if !data.is_empty() {
                    self.abort(AppErrorCode::ProtocolError);
                }
                return;
            }
            ServerPhase::ReadingRequest => {}
        }
        // Check the header before buffering the payload, so an oversize declaration costs nothing.
        if self.buf.len() < FRAME_HEADER_LEN {
            let need = (FRAME_HEADER_LEN - self.buf.len()).min(data.len());
            self.buf.extend_from_slice(&data[..need]);
            let rest = &data[need..];
            if let Err(e) = crate::codec::decode_header(&self.buf, self.max_frame_size) {
                return self.abort(e.app_code());
            }
            self.buf.extend_from_slice(rest);
        } else {
            self.buf.extend_from_slice(data);
        }
        match decode_frame(&self.buf, self.max_frame_size) {
            Err(e) => self.abort(e.app_code()),
            Ok(None) => {
                if fin {
                    self.abort(AppErrorCode::ProtocolError);
                }
            }
            Ok(Some((frame, used))) => {
                if used != self.buf.len() {
                    return self.abort(AppErrorCode::ProtocolError);
                }
                let Frame::Request(req) = frame else {
                    return self.abort(AppErrorCode::ProtocolError);
                };
                let stream_buffer_size = req.stream_buffer_size;
                let request = req.to_request();
                self.buf = Vec::new();
                self.phase = ServerPhase::Running { started: false };
                self.actions.push_back(ServerStreamAction::Submit {
                    request,
                    stream_buffer_size,
                });
            }
        }
    }

    /// The client reset its send side or stopped its receive side (it went away).
    pub fn peer_aborted(&mut self) {
        if self.phase == ServerPhase::Done {
            return;
        }
        if self.is_running() {
            self.actions.push_back(ServerStreamAction::Cancel);
        }
        self.phase = ServerPhase::Done;
    }

    /// The service refused the request.
    pub fn submit_failed(&mut self, err: &ServiceError) {
        if !self.is_running() {
            return;
        }
        let retry_after_ms = match err {
            ServiceError::Overloaded { retry_after_ms } => {
                (*retry_after_ms).min(u64::from(u32::MAX)) as u32
            }
            _ => 0,
        };
        let msg = err.to_string();
        self.send_terminal(&Frame::Error(ErrorFrame {
            code: err.code(),
            retry_after_ms,
            message: &msg,
        }));
    }

    /// Refuses a submitted request before it reaches the service (e.g. `not_found` for a
    /// model the server does not serve): ERROR with `code` and `message`, then FIN.
    ///
    /// ```
    /// use claudelink_proto::*;
    /// let req = InferenceRequest::new("nope", Prompt::Text("hi".into()), 4);
    /// let bytes = Frame::Request(RequestFrame::from_request(&req, 65536)).to_vec().unwrap();
    /// let mut s = ServerStream::new(0, DEFAULT_MAX_FRAME_SIZE);
    /// s.recv(&bytes, true);
    /// assert!(matches!(s.poll_action(), Some(ServerStreamAction::Submit { .. })));
    /// s.reject(ErrorCode::NotFound, "model: nope is not served here");
    /// assert!(matches!(s.poll_action(), Some(ServerStreamAction::Send(_))));
    /// assert_eq!(s.poll_action(), Some(ServerStreamAction::Finish));
    /// assert!(s.is_done());
    /// ```
    pub fn reject(&mut self, code: ErrorCode, message: &str) {
        if !self.is_running() {
            return;
        }
        self.send_terminal(&Frame::Error(ErrorFrame {
            code,
            retry_after_ms: 0,
            message,
        }));
    }

    /// The server is shutting down (its drain deadline passed): a running request is
    /// cancelled and ends with ERROR `shutting_down`; a stream still reading its REQUEST is
    /// reset with `REFUSED` (it was not processed).
    ///
    /// ```
    /// use claudelink_proto::*;
    /// let mut s = ServerStream::new(0, DEFAULT_MAX_FRAME_SIZE);
    /// s.shutting_down();
    /// assert_eq!(s.poll_action(), Some(ServerStreamAction::Abort(AppErrorCode::Refused)));
    /// ```
    pub fn shutting_down(&mut self) {
        match self.phase {
            ServerPhase::Done => {}
            ServerPhase::ReadingRequest => self.abort(AppErrorCode::Refused),
            ServerPhase::Running { .. } => {
                self.actions.push_back(ServerStreamAction::Cancel);
                self.send_terminal(&Frame::Error(ErrorFrame {
                    code: ErrorCode::ShuttingDown,
                    retry_after_ms: 0,
                    message: "the server is shutting down",
                }));
            }
        }
    }

    fn send_terminal(&mut self, frame: &Frame<'_>) {
        match frame.to_vec() {
            Ok(b) => {
                self.actions.push_back(ServerStreamAction::Send(b));
                self.actions.push_back(ServerStreamAction::Finish);
                self.phase = ServerPhase::Done;
            }
            Err(_) => self.abort(AppErrorCode::Internal),
        }
    }

    fn internal_error(&mut self, message: &str) {
        self.actions.push_back(ServerStreamAction::Cancel);
        self.send_terminal(&Frame::Error(ErrorFrame {
            code: ErrorCode::Internal,
            retry_after_ms: 0,
            message,
        }));
    }

    /// An event from the service's stream. Events out of order (a delta before `Started`, a
    /// second `Started`) end the stream with an `internal` ERROR.
    pub fn event(&mut self, ev: &InferenceEvent) {
        let ServerPhase::Running { started } = self.phase else {
            return;
        };
        let ok = match ev {
            InferenceEvent::Started { .. } => !started,
            InferenceEvent::Delta { .. } => started,
            InferenceEvent::Finished { .. } => started,
            InferenceEvent::Error { .. } => true,
            // Not carried over claudelink (its requests never ask for them).
            InferenceEvent::Logprobs(_) | InferenceEvent::ToolCall { .. } => return,
            #[allow(unreachable_patterns)]
            _ => false,
        };
        if !ok {
            return self.internal_error("the service emitted an event out of order");
        }
        let Some(frame) = Frame::from_event(ev, self.request_id) else {
            return;
        };
        match frame {
            Frame::Finished(_) | Frame::Error(_) => self.send_terminal(&frame),
            _ => match frame.to_vec() {
                Ok(b) => {
                    self.phase = ServerPhase::Running { started: true };
                    self.actions.push_back(ServerStreamAction::Send(b));
                }
                Err(_) => self.internal_error("an event could not be encoded"),
            },
        }
    }

    /// The service's stream ended without a terminal event.
    pub fn events_ended(&mut self) {
        if self.is_running() {
            self.send_terminal(&Frame::Error(ErrorFrame {
                code: ErrorCode::Internal,
                retry_after_ms: 0,
                message: "the service ended the stream without finishing it",
            }));
        }
    }
}

/// A protocol violation seen by the client on a response stream.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ClientStreamError {
    /// A frame did not decode.
    #[error("malformed response frame: {0}")]
    Decode(#[from] FrameDecodeError),
    /// A frame that is not allowed in the current state.
    #[error("unexpected {} frame {state}", frame.name())]
    UnexpectedFrame {
        /// The frame.
        frame: FrameType,
        /// Where the stream was ("before STARTED", "after the terminal frame", ...).
        state: &'static str,
    },
    /// The server finished the stream without FINISHED or ERROR.
    #[error("the response ended without a FINISHED or ERROR frame")]
    Truncated,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ClientPhase {
    AwaitStarted,
    Streaming,
    Terminal,
    Closed,
}

/// Client side of one request stream: decodes response frames and checks their order
/// (`STARTED`, `DELTA`*, then `FINISHED` or `ERROR`; `ERROR` may also come first).
#[derive(Debug)]
pub struct ClientStream {
    max_frame_size: u32,
    buf: Vec<u8>,
    phase: ClientPhase,
    request_id: Option<u64>,
    retry_after_ms: u32,
    events: VecDeque<InferenceEvent>,
}

impl ClientStream {
    /// A stream whose request was sent.
    pub fn new(max_frame_size: u32) -> Self {
        Self {
            max_frame_size,
            buf: Vec::new(),
            phase: ClientPhase::AwaitStarted,
            request_id: None,
            retry_after_ms: 0,
            events: VecDeque::new(),
        }
    }

    /// Encodes the request frame a client sends (then it finishes its send side).
    pub fn encode_request(
        request: &InferenceRequest,
        stream_buffer_size: u32,
    ) -> Result<Vec<u8>, crate::codec::EncodeError> {
        if request.output_format.is_some() {
            return Err(crate::codec::EncodeError::NotCarried {
                field: "output_format",
            });
        }
        if request.tools.is_some() {
            return Err(crate::codec::EncodeError::NotCarried { field: "tools" });
        }
        if let Prompt::Chat(m) = &request.prompt
            && m.iter().any(|m| {
                m.role == zerolayer_api::ChatRole::Tool
                    || !m.tool_calls.is_empty()
                    || m.tool_call_id.is_some()
            })
        {
            return Err(crate::codec::EncodeError::NotCarried {
                field: "messages.tool_calls",
            });
        }
        Frame::Request(RequestFrame::from_request(request, stream_buffer_size)).to_vec()
    }

    /// The request id from STARTED.
    pub fn request_id(&self) -> Option<u64> {
        self.request_id
    }

    /// `retry_after_ms` of a received ERROR frame.
    pub fn retry_after_ms(&self) -> u32 {
        self.retry_after_ms
    }

    /// Whether FINISHED or ERROR arrived.
    pub fn is_terminal(&self) -> bool {
        matches!(self.phase, ClientPhase::Terminal | ClientPhase::Closed)
    }

    /// The next decoded event.
    pub fn poll_event(&mut self) -> Option<InferenceEvent> {
        self.events.pop_front()
    }

    /// Data from the server; `fin` when the server finished the stream.
    pub fn recv(&mut self, data: &[u8], fin: bool) -> Result<(), ClientStreamError> {
        self.buf.extend_from_slice(data);
        let mut off = 0;
        let res = loop {
            let rest = &self.buf[off..];
            if rest.is_empty() {
                break Ok(());
            }
            match decode_frame(rest, self.max_frame_size) {
                Err(e) => break Err(e.into()),
                Ok(None) => break Ok(()),
                Ok(Some((frame, used))) => {
                    off += used;
                    let ft = frame.frame_type();
                    let next = match (self.phase, &frame) {
                        (ClientPhase::AwaitStarted, Frame::Started(s)) => {
                            self.request_id = Some(s.request_id);
                            ClientPhase::Streaming
                        }
                        (ClientPhase::AwaitStarted | ClientPhase::Streaming, Frame::Error(e)) => {
                            self.retry_after_ms = e.retry_after_ms;
                            ClientPhase::Terminal
                        }
                        (ClientPhase::Streaming, Frame::Delta(_)) => ClientPhase::Streaming,
                        (ClientPhase::Streaming, Frame::Finished(_)) => ClientPhase::Terminal,
                        (p, _) => {
                            break Err(ClientStreamError::UnexpectedFrame {
                                frame: ft,
                                state: match p {
                                    ClientPhase::AwaitStarted => "before STARTED",
                                    ClientPhase::Streaming => "while streaming",
                                    _ => "after the terminal frame",
                                },
                            });
                        }
                    };
                    if let Some(ev) = frame.to_event() {
                        self.events.push_back(ev);
                    }
                    self.phase = next;
                }
            }
        };
        self.buf.drain(..off);
        res?;
        if fin {
            if !self.buf.is_empty() || self.phase != ClientPhase::Terminal {
                return Err(ClientStreamError::Truncated);
            }
            self.phase = ClientPhase::Closed;
        }
        Ok(())
    }
}

/// Which end of a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// Opens request streams.
    Client,
    /// Serves them.
    Server,
}

/// What the connection shell must do.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum ConnectionAction {
    /// Write these bytes on our control stream.
    SendControl(Vec<u8>),
    /// Close the connection with this code.
    Close(AppErrorCode),
    /// (server) A PING arrived; answer with [`ConnectionState::send_pong`].
    PingReceived {
        /// Nonce to echo.
        nonce: u64,
    },
    /// (client) A PONG answered our PING.
    PongReceived {
        /// Nonce.
        nonce: u64,
        /// Round-trip time.
        rtt: Duration,
        /// Server health.
        health: Health,
    },
    /// (client) A PING went unanswered for the health timeout.
    PingTimedOut {
        /// Nonce.
        nonce: u64,
    },
    /// (server) The client's AUTH was accepted (or, on a server without keys, arrived):
    /// serve its request streams from now on.
    Authenticated {
        /// The label of the matching key ([`ApiKeys::label`]); `None` on a server without keys.
        client: Option<String>,
    },
    /// (client) The server sent GOAWAY: open no new streams here.
    GoAwayReceived {
        /// Why.
        code: Option<ErrorCode>,
        /// Highest stream id the server processes.
        last_stream_id: u64,
        /// Wait before reconnecting, ms.
        retry_after_ms: u32,
    },
}

/// Where a server connection stands with authentication.
#[derive(Debug, Clone)]
enum AuthState {
    /// No keys configured: every connection is served, an AUTH first frame is accepted and
    /// ignored.
    Open,
    /// Keys configured and no AUTH yet: request streams wait, until `deadline`.
    Pending {
        keys: Arc<ApiKeys>,
        deadline: Instant,
    },
    /// A valid AUTH arrived (server), or this is the client.
    Done { client: Option<String> },
    /// The credential was wrong or missing: the connection is closed.
    Failed,
}

/// Connection-level state: the control stream (AUTH/PING/PONG/GOAWAY), authentication and
/// stream admission.
///
/// A server built with [`ConnectionState::require_auth`] serves nothing before the client's
/// AUTH frame, which must be the first frame of the client's control stream:
///
/// ```
/// use std::sync::Arc;
/// use std::time::{Duration, Instant};
/// use claudelink_proto::*;
/// let now = Instant::now();
/// let keys = Arc::new(ApiKeys::new(["sk-1".to_string()]));
/// let mut server = ConnectionState::new(Side::Server, DEFAULT_MAX_FRAME_SIZE, Duration::from_secs(5))
///     .require_auth(keys.clone(), now + Duration::from_secs(5));
/// assert!(!server.is_authenticated());
/// let mut client = ConnectionState::new(Side::Client, DEFAULT_MAX_FRAME_SIZE, Duration::from_secs(5));
/// client.send_auth("sk-1");
/// let Some(ConnectionAction::SendControl(bytes)) = client.poll_action() else { panic!() };
/// server.recv_control(&bytes, now);
/// assert_eq!(
///     server.poll_action(),
///     Some(ConnectionAction::Authenticated { client: Some(keys.label(0).to_string()) })
/// );
/// assert!(server.is_authenticated());
/// ```
#[derive(Debug)]
pub struct ConnectionState {
    side: Side,
    auth: AuthState,
    control_frames_seen: u64,
    max_frame_size: u32,
    buf: Vec<u8>,
    next_nonce: u64,
    outstanding: VecDeque<(u64, Instant)>,
    health_timeout: Duration,
    goaway: Option<u64>,
    closed: bool,
    actions: VecDeque<ConnectionAction>,
}

/// Most unanswered PINGs a client keeps track of (older ones are forgotten).
const MAX_OUTSTANDING_PINGS: usize = 8;

impl ConnectionState {
    /// A fresh connection.
    pub fn new(side: Side, max_frame_size: u32, health_timeout: Duration) -> Self {
        Self {
            side,
            auth: match side {
                Side::Server => AuthState::Open,
                Side::Client => AuthState::Done { client: None },
            },
            control_frames_seen: 0,
            max_frame_size,
            buf: Vec::new(),
            next_nonce: 1,
            outstanding: VecDeque::new(),
            health_timeout,
            goaway: None,
            closed: false,
            actions: VecDeque::new(),
        }
    }

    /// (server) Requires a valid AUTH (a key of `keys`) as the first frame of the client's
    /// control stream, before `deadline` (typically a few seconds after the handshake).
    /// A wrong credential, another frame first, or the deadline passing closes the connection
    /// with `UNAUTHENTICATED`. With an empty key set the server stays open.
    pub fn require_auth(mut self, keys: Arc<ApiKeys>, deadline: Instant) -> Self {
        if self.side == Side::Server && !keys.is_empty() {
            self.auth = AuthState::Pending { keys, deadline };
        }
        self
    }

    /// (server) Whether request streams may be served: no keys are required, or a valid AUTH
    /// arrived. Always `true` on the client.
    pub fn is_authenticated(&self) -> bool {
        matches!(self.auth, AuthState::Open | AuthState::Done { .. })
    }

    /// (server) The label of the key the client authenticated with (`None` before AUTH or on
    /// a server without keys).
    pub fn client_label(&self) -> Option<&str> {
        match &self.auth {
            AuthState::Done { client } => client.as_deref(),
            _ => None,
        }
    }

    /// (client) Sends AUTH with `credential`. Call it first, before any other control frame:
    /// the server requires AUTH to be the first frame of the client's control stream.
    pub fn send_auth(&mut self, credential: &str) {
        self.push_frame(&Frame::Auth(AuthFrame { credential }));
    }

    /// The next action.
    pub fn poll_action(&mut self) -> Option<ConnectionAction> {
        self.actions.pop_front()
    }

    /// Whether GOAWAY was sent (server) or received (client).
    pub fn is_draining(&self) -> bool {
        self.goaway.is_some()
    }

    /// Whether a protocol violation closed the connection.
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    fn close(&mut self, code: AppErrorCode) {
        if code == AppErrorCode::Unauthenticated {
            self.auth = AuthState::Failed;
        }
        if !self.closed {
            self.closed = true;
            self.actions.push_back(ConnectionAction::Close(code));
        }
    }

    fn push_frame(&mut self, f: &Frame<'_>) {
        match f.to_vec() {
            Ok(b) => self.actions.push_back(ConnectionAction::SendControl(b)),
            Err(_) => self.close(AppErrorCode::Internal),
        }
    }

    /// (client) Sends a PING at `now`; returns its nonce.
    pub fn send_ping(&mut self, now: Instant) -> u64 {
        let nonce = self.next_nonce;
        self.next_nonce += 1;
        if self.outstanding.len() == MAX_OUTSTANDING_PINGS {
            self.outstanding.pop_front();
        }
        self.outstanding.push_back((nonce, now));
        self.push_frame(&Frame::Ping(PingFrame { nonce }));
        nonce
    }

    /// (server) Answers a PING.
    pub fn send_pong(&mut self, nonce: u64, health: Health) {
        self.push_frame(&Frame::Pong(PongFrame { nonce, health }));
    }

    /// (server) Sends GOAWAY: streams with ids above `last_stream_id` will be refused.
    pub fn send_goaway(
        &mut self,
        code: Option<ErrorCode>,
        last_stream_id: u64,
        retry_after_ms: u32,
        message: &str,
    ) {
        let last = self
            .goaway
            .map_or(last_stream_id, |l| l.min(last_stream_id));
        self.goaway = Some(last);
        self.push_frame(&Frame::GoAway(GoAwayFrame {
            code,
            last_stream_id: last,
            retry_after_ms,
            message,
        }));
    }

    /// (server) Whether a new request stream is served (`false`: refuse it, it was opened
    /// after our GOAWAY's `last_stream_id`).
    pub fn accept_stream(&self, stream_id: u64) -> bool {
        self.goaway.is_none_or(|last| stream_id <= last)
    }

    /// The earliest time [`ConnectionState::handle_timeout`] has work to do.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let ping = self
            .outstanding
            .front()
            .map(|(_, t)| *t + self.health_timeout);
        let auth = match &self.auth {
            AuthState::Pending { deadline, .. } if !self.closed => Some(*deadline),
            _ => None,
        };
        match (ping, auth) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Expires PINGs older than the health timeout; (server) closes the connection with
    /// `UNAUTHENTICATED` when the AUTH deadline passed.
    pub fn handle_timeout(&mut self, now: Instant) {
        if let AuthState::Pending { deadline, .. } = &self.auth
            && now >= *deadline
        {
            self.close(AppErrorCode::Unauthenticated);
        }
        while let Some(&(nonce, sent)) = self.outstanding.front() {
            if now.saturating_duration_since(sent) < self.health_timeout {
                break;
            }
            self.outstanding.pop_front();
            self.actions
                .push_back(ConnectionAction::PingTimedOut { nonce });
        }
    }

    /// Bytes from the peer's control stream.
    pub fn recv_control(&mut self, data: &[u8], now: Instant) {
        if self.closed {
            return;
        }
        self.buf.extend_from_slice(data);
        let mut off = 0;
        loop {
            let rest = &self.buf[off..];
            let (frame, used) = match decode_frame(rest, self.max_frame_size) {
                Err(e) => {
                    let code = e.app_code();
                    self.buf.clear();
                    return self.close(code);
                }
                Ok(None) => break,
                Ok(Some(x)) => x,
            };
            off += used;
            let first = self.control_frames_seen == 0;
            self.control_frames_seen += 1;
            if let AuthState::Pending { keys, .. } = &self.auth {
                // Nothing but a valid AUTH may come first.
                let client = match &frame {
                    Frame::Auth(a) if first => keys
                        .find(a.credential.as_bytes())
                        .map(|i| keys.label(i).to_owned()),
                    _ => None,
                };
                let Some(client) = client else {
                    self.buf.clear();
                    return self.close(AppErrorCode::Unauthenticated);
                };
                self.auth = AuthState::Done {
                    client: Some(client.clone()),
                };
                self.actions.push_back(ConnectionAction::Authenticated {
                    client: Some(client),
                });
                continue;
            }
            let action = match (self.side, frame) {
                // A server without keys accepts (and ignores) the credential.
                (Side::Server, Frame::Auth(_)) if first => {
                    ConnectionAction::Authenticated { client: None }
                }
                (Side::Server, Frame::Ping(p)) => ConnectionAction::PingReceived { nonce: p.nonce },
                (Side::Client, Frame::Pong(p)) => {
                    let Some(i) = self.outstanding.iter().position(|(n, _)| *n == p.nonce) else {
                        // A late answer to a forgotten or expired ping: harmless.
                        continue;
                    };
                    let (_, sent) = self.outstanding.remove(i).unwrap_or((0, now));
                    ConnectionAction::PongReceived {
                        nonce: p.nonce,
                        rtt: now.saturating_duration_since(sent),
                        health: p.health,
                    }
                }
                (Side::Client, Frame::GoAway(g)) => {
                    if self.goaway.is_some_and(|l| g.last_stream_id > l) {
                        // A later GOAWAY must not raise the limit.
                        self.buf.clear();
                        return self.close(AppErrorCode::ProtocolError);
                    }
                    self.goaway = Some(g.last_stream_id);
                    ConnectionAction::GoAwayReceived {
                        code: g.code,
                        last_stream_id: g.last_stream_id,
                        retry_after_ms: g.retry_after_ms,
                    }
                }
                _ => {
                    self.buf.clear();
                    return self.close(AppErrorCode::ProtocolError);
                }
            };
            self.actions.push_back(action);
        }
        self.buf.drain(..off);
    }

    /// The peer finished its control stream (not allowed while the connection lives).
    pub fn control_finished(&mut self) {
        self.close(AppErrorCode::ProtocolError);
    }
}

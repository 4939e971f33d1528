//! The claudelink frame codec: binary frames with explicit lengths and a hard maximum size.
//!
//! Every frame is a 5-byte header (`type: u8`, `payload_len: u32` little-endian) followed by
//! `payload_len` bytes. Integers are little-endian; strings are a `u32` byte length followed by
//! UTF-8. See `docs/claudelink.md` for the byte layouts and test vectors.
//!
//! Decoding borrows from the input: strings are `&str` views and token ids are a [`TokenIds`]
//! view over the raw little-endian bytes, read without a copy.

use zerolayer_api::{
    CacheStrategy, ChatMessage, ChatRole, ErrorCode, InferenceEvent, InferenceRequest, Prompt,
    SamplingParams, StopReason, Usage,
};

/// Bytes in a frame header (`type: u8`, `payload_len: u32`).
pub const FRAME_HEADER_LEN: usize = 5;
/// The largest payload any claudelink endpoint may accept or send (16 MiB).
pub const HARD_MAX_FRAME_SIZE: u32 = 16 << 20;
/// Default payload limit (256 KiB): 8192 token ids take 32 KiB.
pub const DEFAULT_MAX_FRAME_SIZE: u32 = 256 << 10;
/// Most stop sequences a request may carry.
pub const MAX_STOP_SEQUENCES: u32 = 16;

/// Frame type bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FrameType {
    /// `0x01`, client to server, the first and only frame a client sends on a request stream.
    Request,
    /// `0x02`, server to client, first response frame.
    Started,
    /// `0x03`, server to client, generated tokens.
    Delta,
    /// `0x04`, server to client, terminal: the generation ended.
    Finished,
    /// `0x05`, server to client, terminal: the generation failed.
    Error,
    /// `0x10`, control stream, either direction.
    Ping,
    /// `0x11`, control stream, answer to a ping with health facts.
    Pong,
    /// `0x12`, control stream, server to client: open no new streams here.
    GoAway,
    /// `0x13`, control stream, client to server: the credential; the first frame of the
    /// client's control stream.
    Auth,
}

impl FrameType {
    /// The wire byte.
    pub fn to_u8(self) -> u8 {
        match self {
            Self::Request => 0x01,
            Self::Started => 0x02,
            Self::Delta => 0x03,
            Self::Finished => 0x04,
            Self::Error => 0x05,
            Self::Ping => 0x10,
            Self::Pong => 0x11,
            Self::GoAway => 0x12,
            Self::Auth => 0x13,
        }
    }

    /// Parses a wire byte.
    pub fn from_u8(b: u8) -> Option<Self> {
        Some(match b {
            0x01 => Self::Request,
            0x02 => Self::Started,
            0x03 => Self::Delta,
            0x04 => Self::Finished,
            0x05 => Self::Error,
            0x10 => Self::Ping,
            0x11 => Self::Pong,
            0x12 => Self::GoAway,
            0x13 => Self::Auth,
            _ => return None,
        })
    }

    /// The lowercase name used in the spec and in errors.
    pub fn name(self) -> &'static str {
        match self {
            Self::Request => "REQUEST",
            Self::Started => "STARTED",
            Self::Delta => "DELTA",
            Self::Finished => "FINISHED",
            Self::Error => "ERROR",
            Self::Ping => "PING",
            Self::Pong => "PONG",
            Self::GoAway => "GOAWAY",
            Self::Auth => "AUTH",
        }
    }

    /// Whether the frame belongs on the connection's control stream.
    pub fn is_control(self) -> bool {
        matches!(self, Self::Ping | Self::Pong | Self::GoAway | Self::Auth)
    }
}

/// QUIC application error codes used in `RESET_STREAM`, `STOP_SENDING` and `CONNECTION_CLOSE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AppErrorCode {
    /// `0x00`: graceful close.
    NoError,
    /// `0x01`: a malformed frame or a frame out of order.
    ProtocolError,
    /// `0x02`: a frame header declared a payload over the receiver's limit.
    FrameTooLarge,
    /// `0x03`: an unknown frame type.
    UnknownFrame,
    /// `0x04`: the client dropped the request; the server cancels the work.
    Cancelled,
    /// `0x05`: the server did not process the stream (after GOAWAY); safe to retry elsewhere.
    Refused,
    /// `0x06`: the server failed.
    Internal,
    /// `0x07`: the peer did not read the stream within the send timeout.
    SlowReader,
    /// `0x08`: the connection's request memory budget is exhausted.
    ExcessiveLoad,
    /// `0x09`: the server requires a credential and the client sent none in time, sent a
    /// wrong one, or sent another control frame before it (connection close only).
    Unauthenticated,
}

impl AppErrorCode {
    /// The wire value.
    pub fn to_u64(self) -> u64 {
        match self {
            Self::NoError => 0x00,
            Self::ProtocolError => 0x01,
            Self::FrameTooLarge => 0x02,
            Self::UnknownFrame => 0x03,
            Self::Cancelled => 0x04,
            Self::Refused => 0x05,
            Self::Internal => 0x06,
            Self::SlowReader => 0x07,
            Self::ExcessiveLoad => 0x08,
            Self::Unauthenticated => 0x09,
        }
    }

    /// Parses a wire value.
    pub fn from_u64(v: u64) -> Option<Self> {
        Some(match v {
            0x00 => Self::NoError,
            0x01 => Self::ProtocolError,
            0x02 => Self::FrameTooLarge,
            0x03 => Self::UnknownFrame,
            0x04 => Self::Cancelled,
            0x05 => Self::Refused,
            0x06 => Self::Internal,
            0x07 => Self::SlowReader,
            0x08 => Self::ExcessiveLoad,
            0x09 => Self::Unauthenticated,
            _ => return None,
        })
    }
}

/// The wire value of an [`ErrorCode`] (ERROR and GOAWAY frames).
pub fn error_code_to_u16(code: ErrorCode) -> u16 {
    match code {
        ErrorCode::InvalidRequest => 1,
        ErrorCode::ContextLength => 2,
        ErrorCode::NotFound => 3,
        ErrorCode::Overloaded => 4,
        ErrorCode::Cancelled => 5,
        ErrorCode::Timeout => 6,
        ErrorCode::Internal => 7,
        ErrorCode::ShuttingDown => 8,
    }
}

/// Parses the wire value of an [`ErrorCode`].
pub fn error_code_from_u16(v: u16) -> Option<ErrorCode> {
    Some(match v {
        1 => ErrorCode::InvalidRequest,
        2 => ErrorCode::ContextLength,
        3 => ErrorCode::NotFound,
        4 => ErrorCode::Overloaded,
        5 => ErrorCode::Cancelled,
        6 => ErrorCode::Timeout,
        7 => ErrorCode::Internal,
        8 => ErrorCode::ShuttingDown,
        _ => return None,
    })
}

/// The snake_case name of an [`ErrorCode`] as the spec writes it.
pub fn error_code_name(code: ErrorCode) -> &'static str {
    match code {
        ErrorCode::InvalidRequest => "invalid_request",
        ErrorCode::ContextLength => "context_length",
        ErrorCode::NotFound => "not_found",
        ErrorCode::Overloaded => "overloaded",
        ErrorCode::Cancelled => "cancelled",
        ErrorCode::Timeout => "timeout",
        ErrorCode::Internal => "internal",
        ErrorCode::ShuttingDown => "shutting_down",
    }
}

/// Token ids as carried on the wire: a view over little-endian `u32`s, read without a copy.
///
/// Decoded frames hold the raw payload bytes; [`TokenIds::get`] and [`TokenIds::iter`] read them
/// with `u32::from_le_bytes`, and [`TokenIds::as_u32_slice`] reinterprets them in place when the
/// host is little-endian and the bytes happen to be 4-aligned.
///
/// ```
/// use claudelink_proto::TokenIds;
/// let ids = [1u32, 2, 300];
/// let view = TokenIds::from_slice(&ids);
/// assert_eq!(view.iter().collect::<Vec<_>>(), vec![1, 2, 300]);
/// let wire = TokenIds::from_le_bytes(&[7, 0, 0, 0, 1, 1, 0, 0]).unwrap();
/// assert_eq!(wire.get(1), Some(257));
/// ```
#[derive(Clone, Copy)]
pub struct TokenIds<'a>(IdsRepr<'a>);

#[derive(Clone, Copy)]
enum IdsRepr<'a> {
    Le(&'a [u8]),
    Native(&'a [u32]),
}

impl<'a> TokenIds<'a> {
    /// A view over native ids (for encoding).
    pub fn from_slice(ids: &'a [u32]) -> Self {
        Self(IdsRepr::Native(ids))
    }

    /// A view over little-endian bytes; `None` when the length is not a multiple of 4.
    pub fn from_le_bytes(bytes: &'a [u8]) -> Option<Self> {
        bytes
            .len()
            .is_multiple_of(4)
            .then_some(Self(IdsRepr::Le(bytes)))
    }

    /// Number of ids.
    pub fn len(&self) -> usize {
        match self.0 {
            IdsRepr::Le(b) => b.len() / 4,
            IdsRepr::Native(s) => s.len(),
        }
    }

    /// Whether there are no ids.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The id at `i`.
    pub fn get(&self, i: usize) -> Option<u32> {
        match self.0 {
            IdsRepr::Le(b) => b
                .get(i * 4..i * 4 + 4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            IdsRepr::Native(s) => s.get(i).copied(),
        }
    }

    /// Iterates the ids in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = u32> + 'a {
        let this = *self;
        (0..this.len()).map(move |i| match this.0 {
            IdsRepr::Le(b) => {
                let c = &b[i * 4..i * 4 + 4];
                u32::from_le_bytes([c[0], c[1], c[2], c[3]])
            }
            IdsRepr::Native(s) => s[i],
        })
    }

    /// The ids as a `&[u32]` without copying, when possible (little-endian host and aligned
    /// bytes, or a native view).
    pub fn as_u32_slice(&self) -> Option<&'a [u32]> {
        match self.0 {
            IdsRepr::Native(s) => Some(s),
            IdsRepr::Le(b) => {
                if cfg!(target_endian = "little") {
                    bytemuck::try_cast_slice(b).ok()
                } else {
                    None
                }
            }
        }
    }

    /// Copies the ids into a vector.
    pub fn to_vec(&self) -> Vec<u32> {
        match self.as_u32_slice() {
            Some(s) => s.to_vec(),
            None => self.iter().collect(),
        }
    }

    fn write_le(&self, out: &mut Vec<u8>) {
        match self.0 {
            IdsRepr::Le(b) => out.extend_from_slice(b),
            IdsRepr::Native(s) => {
                if cfg!(target_endian = "little") {
                    out.extend_from_slice(bytemuck::cast_slice(s));
                } else {
                    for id in s {
                        out.extend_from_slice(&id.to_le_bytes());
                    }
                }
            }
        }
    }
}

impl PartialEq for TokenIds<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

impl std::fmt::Debug for TokenIds<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// A chat turn borrowed from a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChatMessageRef<'a> {
    /// Author.
    pub role: ChatRole,
    /// Text.
    pub content: &'a str,
}

/// A prompt borrowed from a frame.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptRef<'a> {
    /// Raw text.
    Text(&'a str),
    /// Chat turns.
    Chat(Vec<ChatMessageRef<'a>>),
    /// Token ids (zero-copy view).
    TokenIds(TokenIds<'a>),
}

/// REQUEST frame.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestFrame<'a> {
    /// Model name.
    pub model: &'a str,
    /// Cap on generated tokens.
    pub max_tokens: u32,
    /// Scheduling priority.
    pub priority: i32,
    /// Bytes the server may buffer ahead of the client on this stream.
    pub stream_buffer_size: u32,
    /// Sampling parameters (`None` fields are absent on the wire).
    pub sampling: SamplingParams,
    /// Stop sequences.
    pub stop_sequences: Vec<&'a str>,
    /// Warm-up hint.
    pub cache_strategy: CacheStrategy,
    /// The prompt.
    pub prompt: PromptRef<'a>,
}

impl<'a> RequestFrame<'a> {
    /// Borrows a service request as a frame.
    pub fn from_request(req: &'a InferenceRequest, stream_buffer_size: u32) -> Self {
        let prompt = match &req.prompt {
            Prompt::Text(t) => PromptRef::Text(t),
            Prompt::Chat(m) => PromptRef::Chat(
                m.iter()
                    .map(|m| ChatMessageRef {
                        role: m.role,
                        content: &m.content,
                    })
                    .collect(),
            ),
            Prompt::TokenIds(ids) => PromptRef::TokenIds(TokenIds::from_slice(ids)),
        };
        Self {
            model: &req.model,
            max_tokens: req.max_tokens,
            priority: req.priority,
            stream_buffer_size,
            sampling: req.sampling.clone(),
            stop_sequences: req.stop_sequences.iter().map(String::as_str).collect(),
            cache_strategy: req.cache_strategy,
            prompt,
        }
    }

    /// Copies the frame into a service request.
    pub fn to_request(&self) -> InferenceRequest {
        let prompt = match &self.prompt {
            PromptRef::Text(t) => Prompt::Text((*t).to_owned()),
            PromptRef::Chat(m) => Prompt::Chat(
                m.iter()
                    .map(|m| ChatMessage::new(m.role, m.content))
                    .collect(),
            ),
            PromptRef::TokenIds(ids) => Prompt::TokenIds(ids.to_vec()),
        };
        let mut r = InferenceRequest::new(self.model, prompt, self.max_tokens);
        r.sampling = self.sampling.clone();
        r.stop_sequences = self
            .stop_sequences
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
        r.cache_strategy = self.cache_strategy;
        r.priority = self.priority;
        r
    }
}

/// STARTED frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StartedFrame {
    /// Server-assigned request id (the QUIC stream id).
    pub request_id: u64,
    /// Prompt length in tokens.
    pub input_tokens: u32,
}

/// DELTA frame.
#[derive(Debug, Clone, PartialEq)]
pub struct DeltaFrame<'a> {
    /// New token ids.
    pub ids: TokenIds<'a>,
    /// Text completed by them.
    pub text: &'a str,
}

/// FINISHED frame.
#[derive(Debug, Clone, PartialEq)]
pub struct FinishedFrame<'a> {
    /// Why the generation ended.
    pub stop_reason: StopReason,
    /// The matched stop sequence.
    pub stop_sequence: Option<&'a str>,
    /// Token counts.
    pub usage: Usage,
}

/// ERROR frame.
#[derive(Debug, Clone, PartialEq)]
pub struct ErrorFrame<'a> {
    /// Error class.
    pub code: ErrorCode,
    /// Suggested wait before retrying, in ms (0: none).
    pub retry_after_ms: u32,
    /// Detail.
    pub message: &'a str,
}

/// PING frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PingFrame {
    /// Opaque value echoed by the PONG.
    pub nonce: u64,
}

/// PONG frame: the answer to a PING with the server's health.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PongFrame {
    /// The PING's nonce.
    pub nonce: u64,
    /// Health facts (the client's PONG carries zeros and `ready = true`).
    pub health: Health,
}

/// Health facts a server reports in a PONG.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Health {
    /// The service is ready to serve.
    pub ready: bool,
    /// Requests waiting for admission.
    pub queue_depth: u32,
    /// Sequences in the batch.
    pub running: u32,
    /// Request streams open on this connection.
    pub active_streams: u32,
}

/// GOAWAY frame.
#[derive(Debug, Clone, PartialEq)]
pub struct GoAwayFrame<'a> {
    /// Why (`None` = graceful shutdown).
    pub code: Option<ErrorCode>,
    /// Highest client bidirectional stream id the server processes; later ones are refused.
    pub last_stream_id: u64,
    /// Suggested wait before reconnecting to this server, in ms.
    pub retry_after_ms: u32,
    /// Detail.
    pub message: &'a str,
}

/// AUTH frame: the client's credential (an API key), checked by a server configured with keys.
///
/// ```
/// use claudelink_proto::{AuthFrame, Frame, decode_frame, DEFAULT_MAX_FRAME_SIZE};
/// let bytes = Frame::Auth(AuthFrame { credential: "sk-1" }).to_vec().unwrap();
/// let (frame, _) = decode_frame(&bytes, DEFAULT_MAX_FRAME_SIZE).unwrap().unwrap();
/// assert_eq!(frame, Frame::Auth(AuthFrame { credential: "sk-1" }));
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct AuthFrame<'a> {
    /// The credential (never printed by `Debug`).
    pub credential: &'a str,
}

impl std::fmt::Debug for AuthFrame<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuthFrame")
            .field(
                "credential",
                &format_args!("<{} bytes>", self.credential.len()),
            )
            .finish()
    }
}

/// Any claudelink frame.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Frame<'a> {
    /// REQUEST.
    Request(RequestFrame<'a>),
    /// STARTED.
    Started(StartedFrame),
    /// DELTA.
    Delta(DeltaFrame<'a>),
    /// FINISHED.
    Finished(FinishedFrame<'a>),
    /// ERROR.
    Error(ErrorFrame<'a>),
    /// PING.
    Ping(PingFrame),
    /// PONG.
    Pong(PongFrame),
    /// GOAWAY.
    GoAway(GoAwayFrame<'a>),
    /// AUTH.
    Auth(AuthFrame<'a>),
}

impl<'a> Frame<'a> {
    /// The frame's type.
    pub fn frame_type(&self) -> FrameType {
        match self {
            Self::Request(_) => FrameType::Request,
            Self::Started(_) => FrameType::Started,
            Self::Delta(_) => FrameType::Delta,
            Self::Finished(_) => FrameType::Finished,
            Self::Error(_) => FrameType::Error,
            Self::Ping(_) => FrameType::Ping,
            Self::Pong(_) => FrameType::Pong,
            Self::GoAway(_) => FrameType::GoAway,
            Self::Auth(_) => FrameType::Auth,
        }
    }

    /// The response frame of a service event. `request_id` fills a STARTED frame. `None` for
    /// [`InferenceEvent::Logprobs`], which claudelink does not carry.
    pub fn from_event(ev: &'a InferenceEvent, request_id: u64) -> Option<Self> {
        Some(match ev {
            InferenceEvent::Started { input_tokens } => Self::Started(StartedFrame {
                request_id,
                input_tokens: *input_tokens,
            }),
            InferenceEvent::Delta { ids, text } => Self::Delta(DeltaFrame {
                ids: TokenIds::from_slice(ids),
                text,
            }),
            InferenceEvent::Finished {
                stop_reason,
                stop_sequence,
                usage,
            } => Self::Finished(FinishedFrame {
                stop_reason: *stop_reason,
                stop_sequence: stop_sequence.as_deref(),
                usage: *usage,
            }),
            InferenceEvent::Error { code, message } => Self::Error(ErrorFrame {
                code: *code,
                retry_after_ms: 0,
                message,
            }),
            InferenceEvent::Logprobs(_) | InferenceEvent::ToolCall { .. } => return None,
        })
    }

    /// The service event of a response frame (`None` for REQUEST and control frames).
    pub fn to_event(&self) -> Option<InferenceEvent> {
        Some(match self {
            Self::Started(s) => InferenceEvent::Started {
                input_tokens: s.input_tokens,
            },
            Self::Delta(d) => InferenceEvent::Delta {
                ids: d.ids.to_vec(),
                text: d.text.to_owned(),
            },
            Self::Finished(f) => InferenceEvent::Finished {
                stop_reason: f.stop_reason,
                stop_sequence: f.stop_sequence.map(str::to_owned),
                usage: f.usage,
            },
            Self::Error(e) => InferenceEvent::Error {
                code: e.code,
                message: e.message.to_owned(),
            },
            _ => return None,
        })
    }

    /// Appends the encoded frame to `out` and returns its length in bytes.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<usize, EncodeError> {
        let start = out.len();
        out.push(self.frame_type().to_u8());
        out.extend_from_slice(&[0; 4]);
        let res = self.encode_payload(out);
        if let Err(e) = res {
            out.truncate(start);
            return Err(e);
        }
        let payload = out.len() - start - FRAME_HEADER_LEN;
        if payload > HARD_MAX_FRAME_SIZE as usize {
            out.truncate(start);
            return Err(EncodeError::FrameTooLarge {
                frame: self.frame_type(),
                len: payload,
                max: HARD_MAX_FRAME_SIZE,
            });
        }
        out[start + 1..start + 5].copy_from_slice(&(payload as u32).to_le_bytes());
        Ok(out.len() - start)
    }

    /// Encodes into a fresh vector.
    pub fn to_vec(&self) -> Result<Vec<u8>, EncodeError> {
        let mut v = Vec::new();
        self.encode(&mut v)?;
        Ok(v)
    }

    fn encode_payload(&self, out: &mut Vec<u8>) -> Result<(), EncodeError> {
        let ft = self.frame_type();
        match self {
            Self::Request(r) => {
                let (kind, ids_len) = match &r.prompt {
                    PromptRef::Text(_) => (0u8, 0),
                    PromptRef::Chat(_) => (1, 0),
                    PromptRef::TokenIds(ids) => (2, ids.len()),
                };
                out.reserve(64 + r.model.len() + ids_len * 4);
                out.push(kind);
                out.push(match r.cache_strategy {
                    CacheStrategy::Deterministic => 0,
                    CacheStrategy::Adaptive => 1,
                });
                let s = &r.sampling;
                for (field, set) in [
                    ("frequency_penalty", s.frequency_penalty.is_some()),
                    ("presence_penalty", s.presence_penalty.is_some()),
                ] {
                    if set {
                        return Err(EncodeError::NotCarried { field });
                    }
                }
                let mut bits = 0u8;
                for (i, present) in [
                    s.temperature.is_some(),
                    s.top_p.is_some(),
                    s.top_k.is_some(),
                    s.min_p.is_some(),
                    s.repetition_penalty.is_some(),
                    s.seed.is_some(),
                ]
                .into_iter()
                .enumerate()
                {
                    if present {
                        bits |= 1 << i;
                    }
                }
                out.push(bits);
                out.push(0);
                put_u32(out, r.max_tokens);
                out.extend_from_slice(&r.priority.to_le_bytes());
                put_u32(out, r.stream_buffer_size);
                for f in [s.temperature, s.top_p] {
                    put_f32(out, ft, f)?;
                }
                put_u32(out, s.top_k.unwrap_or(0));
                for f in [s.min_p, s.repetition_penalty] {
                    put_f32(out, ft, f)?;
                }
                out.extend_from_slice(&s.seed.unwrap_or(0).to_le_bytes());
                put_str(out, ft, r.model)?;
                if r.stop_sequences.len() > MAX_STOP_SEQUENCES as usize {
                    return Err(EncodeError::TooMany {
                        field: "stop_sequences",
                        count: r.stop_sequences.len(),
                        max: MAX_STOP_SEQUENCES,
                    });
                }
                put_u32(out, r.stop_sequences.len() as u32);
                for s in &r.stop_sequences {
                    put_str(out, ft, s)?;
                }
                match &r.prompt {
                    PromptRef::Text(t) => put_str(out, ft, t)?,
                    PromptRef::Chat(m) => {
                        put_len(out, ft, m.len())?;
                        for m in m {
                            out.push(match m.role {
                                ChatRole::System => 0,
                                ChatRole::User => 1,
                                ChatRole::Assistant => 2,
                                ChatRole::Tool => {
                                    return Err(EncodeError::NotCarried {
                                        field: "messages.role",
                                    });
                                }
                            });
                            put_str(out, ft, m.content)?;
                        }
                    }
                    PromptRef::TokenIds(ids) => {
                        put_len(out, ft, ids.len())?;
                        ids.write_le(out);
                    }
                }
            }
            Self::Started(s) => {
                out.extend_from_slice(&s.request_id.to_le_bytes());
                put_u32(out, s.input_tokens);
            }
            Self::Delta(d) => {
                put_len(out, ft, d.ids.len())?;
                d.ids.write_le(out);
                put_str(out, ft, d.text)?;
            }
            Self::Finished(f) => {
                out.push(match f.stop_reason {
                    StopReason::EndTurn => 0,
                    StopReason::MaxTokens => 1,
                    StopReason::StopSequence => 2,
                    StopReason::ToolUse => 3,
                });
                out.push(u8::from(f.stop_sequence.is_some()));
                put_u32(out, f.usage.input_tokens);
                put_u32(out, f.usage.output_tokens);
                if let Some(s) = f.stop_sequence {
                    put_str(out, ft, s)?;
                }
            }
            Self::Error(e) => {
                out.extend_from_slice(&error_code_to_u16(e.code).to_le_bytes());
                put_u32(out, e.retry_after_ms);
                put_str(out, ft, e.message)?;
            }
            Self::Ping(p) => out.extend_from_slice(&p.nonce.to_le_bytes()),
            Self::Pong(p) => {
                out.extend_from_slice(&p.nonce.to_le_bytes());
                out.push(u8::from(p.health.ready));
                put_u32(out, p.health.queue_depth);
                put_u32(out, p.health.running);
                put_u32(out, p.health.active_streams);
            }
            Self::GoAway(g) => {
                out.extend_from_slice(&g.code.map_or(0, error_code_to_u16).to_le_bytes());
                out.extend_from_slice(&g.last_stream_id.to_le_bytes());
                put_u32(out, g.retry_after_ms);
                put_str(out, ft, g.message)?;
            }
            Self::Auth(a) => put_str(out, ft, a.credential)?,
        }
        Ok(())
    }
}

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_f32(out: &mut Vec<u8>, frame: FrameType, v: Option<f32>) -> Result<(), EncodeError> {
    let v = v.unwrap_or(0.0);
    if !v.is_finite() {
        return Err(EncodeError::NonFinite { frame, value: v });
    }
    out.extend_from_slice(&v.to_bits().to_le_bytes());
    Ok(())
}

fn put_len(out: &mut Vec<u8>, frame: FrameType, len: usize) -> Result<(), EncodeError> {
    if len > HARD_MAX_FRAME_SIZE as usize {
        return Err(EncodeError::FrameTooLarge {
            frame,
            len,
            max: HARD_MAX_FRAME_SIZE,
        });
    }
    put_u32(out, len as u32);
    Ok(())
}

fn put_str(out: &mut Vec<u8>, frame: FrameType, s: &str) -> Result<(), EncodeError> {
    put_len(out, frame, s.len())?;
    out.extend_from_slice(s.as_bytes());
    Ok(())
}

/// Why a frame could not be encoded.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum EncodeError {
    /// The payload would exceed [`HARD_MAX_FRAME_SIZE`].
    #[error("{} payload of {len} bytes exceeds the maximum of {max} bytes", frame.name())]
    FrameTooLarge {
        /// Frame type.
        frame: FrameType,
        /// Payload length (or the offending element count).
        len: usize,
        /// The limit.
        max: u32,
    },
    /// A float field was NaN or infinite.
    #[error("{} carries a non-finite float {value}", frame.name())]
    NonFinite {
        /// Frame type.
        frame: FrameType,
        /// The value.
        value: f32,
    },
    /// Too many elements in a list field.
    #[error("{count} {field} exceed the maximum of {max}")]
    TooMany {
        /// The field.
        field: &'static str,
        /// Elements given.
        count: usize,
        /// The limit.
        max: u32,
    },
    /// A request sets a field this protocol version does not carry (rather than dropping it).
    #[error("claudelink does not carry `{field}`")]
    NotCarried {
        /// The field.
        field: &'static str,
    },
}

/// Why bytes could not be decoded as a frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameDecodeError {
    /// The header declared a payload over the receiver's limit (checked before buffering it).
    #[error("frame type {frame_type:#04x} declares a {len}-byte payload; the limit is {max}")]
    FrameTooLarge {
        /// Raw type byte.
        frame_type: u8,
        /// Declared payload length.
        len: u32,
        /// The limit.
        max: u32,
    },
    /// The type byte is not a claudelink/2 frame type.
    #[error("unknown frame type {frame_type:#04x}")]
    UnknownFrameType {
        /// Raw type byte.
        frame_type: u8,
    },
    /// The payload ended inside a field.
    #[error("{} payload truncated in field `{field}` at byte {offset}", frame.name())]
    Truncated {
        /// Frame type.
        frame: FrameType,
        /// The field being read.
        field: &'static str,
        /// Payload offset where the field starts.
        offset: usize,
    },
    /// Bytes remained after the last field.
    #[error("{} payload has {extra} trailing bytes", frame.name())]
    TrailingBytes {
        /// Frame type.
        frame: FrameType,
        /// Extra bytes.
        extra: usize,
    },
    /// A string field is not UTF-8.
    #[error("{} field `{field}` is not valid UTF-8", frame.name())]
    InvalidUtf8 {
        /// Frame type.
        frame: FrameType,
        /// The field.
        field: &'static str,
    },
    /// A field holds a value outside its domain (enum byte, reserved bits, non-finite float,
    /// a parameter marked absent but not zero).
    #[error("{} field `{field}` has invalid value {value:#x}", frame.name())]
    InvalidValue {
        /// Frame type.
        frame: FrameType,
        /// The field.
        field: &'static str,
        /// The raw value.
        value: u64,
    },
    /// A list is longer than allowed.
    #[error("{} field `{field}` has {count} elements; the limit is {max}", frame.name())]
    TooMany {
        /// Frame type.
        frame: FrameType,
        /// The field.
        field: &'static str,
        /// Declared count.
        count: u64,
        /// The limit.
        max: u64,
    },
}

impl FrameDecodeError {
    /// The QUIC application error code a receiver uses to end the stream or connection.
    pub fn app_code(&self) -> AppErrorCode {
        match self {
            Self::FrameTooLarge { .. } => AppErrorCode::FrameTooLarge,
            Self::UnknownFrameType { .. } => AppErrorCode::UnknownFrame,
            _ => AppErrorCode::ProtocolError,
        }
    }
}

/// Reads the header at the start of `buf`: `Ok(None)` when fewer than 5 bytes are there.
/// Checks the type and the declared length against `max_frame_size` before any payload is read.
pub fn decode_header(
    buf: &[u8],
    max_frame_size: u32,
) -> Result<Option<(FrameType, u32)>, FrameDecodeError> {
    if buf.len() < FRAME_HEADER_LEN {
        return Ok(None);
    }
    let ty = buf[0];
    let len = u32::from_le_bytes([buf[1], buf[2], buf[3], buf[4]]);
    let Some(ft) = FrameType::from_u8(ty) else {
        return Err(FrameDecodeError::UnknownFrameType { frame_type: ty });
    };
    let max = max_frame_size.min(HARD_MAX_FRAME_SIZE);
    if len > max {
        return Err(FrameDecodeError::FrameTooLarge {
            frame_type: ty,
            len,
            max,
        });
    }
    Ok(Some((ft, len)))
}

/// Decodes one frame from the start of `buf`.
///
/// Returns `Ok(None)` when `buf` holds only part of a frame (read more and call again), or the
/// frame and the number of bytes it took. Nothing is allocated from a declared size: lists are
/// bounded by the bytes actually present.
///
/// ```
/// use claudelink_proto::{decode_frame, Frame, PingFrame, DEFAULT_MAX_FRAME_SIZE};
/// let bytes = Frame::Ping(PingFrame { nonce: 7 }).to_vec().unwrap();
/// let (frame, used) = decode_frame(&bytes, DEFAULT_MAX_FRAME_SIZE).unwrap().unwrap();
/// assert_eq!(used, bytes.len());
/// assert_eq!(frame, Frame::Ping(PingFrame { nonce: 7 }));
/// assert!(decode_frame(&bytes[..3], DEFAULT_MAX_FRAME_SIZE).unwrap().is_none());
/// ```
pub fn decode_frame(
    buf: &[u8],
    max_frame_size: u32,
) -> Result<Option<(Frame<'_>, usize)>, FrameDecodeError> {
    let Some((ft, len)) = decode_header(buf, max_frame_size)? else {
        return Ok(None);
    };
    let total = FRAME_HEADER_LEN + len as usize;
    if buf.len() < total {
        return Ok(None);
    }
    let payload = &buf[FRAME_HEADER_LEN..total];
    let frame = decode_payload(ft, payload)?;
    Ok(Some((frame, total)))
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    frame: FrameType,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, field: &'static str) -> Result<&'a [u8], FrameDecodeError> {
        if self.buf.len() - self.pos < n {
            return Err(FrameDecodeError::Truncated {
                frame: self.frame,
                field,
                offset: self.pos,
            });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn u8(&mut self, field: &'static str) -> Result<u8, FrameDecodeError> {
        Ok(self.take(1, field)?[0])
    }

    fn u16(&mut self, field: &'static str) -> Result<u16, FrameDecodeError> {
        let b = self.take(2, field)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    fn u32(&mut self, field: &'static str) -> Result<u32, FrameDecodeError> {
        let b = self.take(4, field)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, field: &'static str) -> Result<u64, FrameDecodeError> {
        let b = self.take(8, field)?;
        let mut a = [0; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    fn f32(&mut self, field: &'static str) -> Result<f32, FrameDecodeError> {
        let bits = self.u32(field)?;
        let v = f32::from_bits(bits);
        if !v.is_finite() {
            return Err(self.invalid(field, u64::from(bits)));
        }
        Ok(v)
    }

    fn str(&mut self, field: &'static str) -> Result<&'a str, FrameDecodeError> {
        let len = self.u32(field)? as usize;
        let b = self.take(len, field)?;
        std::str::from_utf8(b).map_err(|_| FrameDecodeError::InvalidUtf8 {
            frame: self.frame,
            field,
        })
    }

    /// A count of elements each at least `min_elem` bytes, checked against the bytes left.
    fn count(&mut self, field: &'static str, min_elem: usize) -> Result<usize, FrameDecodeError> {
        let offset = self.pos;
        let n = self.u32(field)? as usize;
        if n.saturating_mul(min_elem) > self.buf.len() - self.pos {
            return Err(FrameDecodeError::Truncated {
                frame: self.frame,
                field,
                offset,
            });
        }
        Ok(n)
    }

    fn ids(&mut self, field: &'static str) -> Result<TokenIds<'a>, FrameDecodeError> {
        let n = self.count(field, 4)?;
        let b = self.take(n * 4, field)?;
        Ok(TokenIds(IdsRepr::Le(b)))
    }

    fn invalid(&self, field: &'static str, value: u64) -> FrameDecodeError {
        FrameDecodeError::InvalidValue {
            frame: self.frame,
            field,
            value,
        }
    }

    fn finish(&self) -> Result<(), FrameDecodeError> {
        if self.pos != self.buf.len() {
            return Err(FrameDecodeError::TrailingBytes {
                frame: self.frame,
                extra: self.buf.len() - self.pos,
            });
        }
        Ok(())
    }
}

/// Decodes a payload whose type and length the header gave.
pub fn decode_payload(ft: FrameType, payload: &[u8]) -> Result<Frame<'_>, FrameDecodeError> {
    let mut r = Reader {
        buf: payload,
        pos: 0,
        frame: ft,
    };
    let frame = match ft {
        FrameType::Request => Frame::Request(decode_request(&mut r)?),
        FrameType::Started => Frame::Started(StartedFrame {
            request_id: r.u64("request_id")?,
            input_tokens: r.u32("input_tokens")?,
        }),
        FrameType::Delta => Frame::Delta(DeltaFrame {
            ids: r.ids("ids")?,
            text: r.str("text")?,
        }),
        FrameType::Finished => {
            let reason = r.u8("stop_reason")?;
            let stop_reason = match reason {
                0 => StopReason::EndTurn,
                1 => StopReason::MaxTokens,
                2 => StopReason::StopSequence,
                3 => StopReason::ToolUse,
                v => return Err(r.invalid("stop_reason", u64::from(v))),
            };
            let has = r.u8("has_stop_sequence")?;
            if has > 1 {
                return Err(r.invalid("has_stop_sequence", u64::from(has)));
            }
            let usage = Usage {
                input_tokens: r.u32("input_tokens")?,
                output_tokens: r.u32("output_tokens")?,
            };
            let stop_sequence = if has == 1 {
                Some(r.str("stop_sequence")?)
            } else {
                None
            };
            Frame::Finished(FinishedFrame {
                stop_reason,
                stop_sequence,
                usage,
            })
        }
        FrameType::Error => {
            let raw = r.u16("code")?;
            let code = error_code_from_u16(raw).ok_or_else(|| r.invalid("code", raw.into()))?;
            Frame::Error(ErrorFrame {
                code,
                retry_after_ms: r.u32("retry_after_ms")?,
                message: r.str("message")?,
            })
        }
        FrameType::Ping => Frame::Ping(PingFrame {
            nonce: r.u64("nonce")?,
        }),
        FrameType::Pong => {
            let nonce = r.u64("nonce")?;
            let ready = r.u8("ready")?;
            if ready > 1 {
                return Err(r.invalid("ready", ready.into()));
            }
            Frame::Pong(PongFrame {
                nonce,
                health: Health {
                    ready: ready == 1,
                    queue_depth: r.u32("queue_depth")?,
                    running: r.u32("running")?,
                    active_streams: r.u32("active_streams")?,
                },
            })
        }
        FrameType::GoAway => {
            let raw = r.u16("code")?;
            let code = if raw == 0 {
                None
            } else {
                Some(error_code_from_u16(raw).ok_or_else(|| r.invalid("code", raw.into()))?)
            };
            Frame::GoAway(GoAwayFrame {
                code,
                last_stream_id: r.u64("last_stream_id")?,
                retry_after_ms: r.u32("retry_after_ms")?,
                message: r.str("message")?,
            })
        }
        FrameType::Auth => Frame::Auth(AuthFrame {
            credential: r.str("credential")?,
        }),
    };
    r.finish()?;
    Ok(frame)
}

fn decode_request<'a>(r: &mut Reader<'a>) -> Result<RequestFrame<'a>, FrameDecodeError> {
    let kind = r.u8("prompt_kind")?;
    if kind > 2 {
        return Err(r.invalid("prompt_kind", kind.into()));
    }
    let cache_strategy = match r.u8("cache_strategy")? {
        0 => CacheStrategy::Deterministic,
        1 => CacheStrategy::Adaptive,
        v => return Err(r.invalid("cache_strategy", v.into())),
    };
    let bits = r.u8("sampling_flags")?;
    if bits & 0xC0 != 0 {
        return Err(r.invalid("sampling_flags", bits.into()));
    }
    let reserved = r.u8("reserved")?;
    if reserved != 0 {
        return Err(r.invalid("reserved", reserved.into()));
    }
    let max_tokens = r.u32("max_tokens")?;
    let priority = r.u32("priority")? as i32;
    let stream_buffer_size = r.u32("stream_buffer_size")?;
    let temperature = r.f32("temperature")?;
    let top_p = r.f32("top_p")?;
    let top_k = r.u32("top_k")?;
    let min_p = r.f32("min_p")?;
    let repetition_penalty = r.f32("repetition_penalty")?;
    let seed = r.u64("seed")?;
    // An absent parameter must be encoded as zero so that every request has one encoding.
    let mut sampling = SamplingParams::default();
    macro_rules! field {
        ($bit:expr, $name:literal, $v:expr, $raw:expr, $zero:expr) => {
            if bits & (1 << $bit) != 0 {
                Some($v)
            } else if $raw != $zero {
                return Err(r.invalid($name, $raw));
            } else {
                None
            }
        };
    }
    sampling.temperature = field!(
        0,
        "temperature",
        temperature,
        u64::from(temperature.to_bits()),
        0
    );
    sampling.top_p = field!(1, "top_p", top_p, u64::from(top_p.to_bits()), 0);
    sampling.top_k = field!(2, "top_k", top_k, u64::from(top_k), 0);
    sampling.min_p = field!(3, "min_p", min_p, u64::from(min_p.to_bits()), 0);
    sampling.repetition_penalty = field!(
        4,
        "repetition_penalty",
        repetition_penalty,
        u64::from(repetition_penalty.to_bits()),
        0
    );
    sampling.seed = field!(5, "seed", seed, seed, 0);
    let model = r.str("model")?;
    let n_stop = r.count("stop_sequences", 4)?;
    if n_stop > MAX_STOP_SEQUENCES as usize {
        return Err(FrameDecodeError::TooMany {
            frame: FrameType::Request,
            field: "stop_sequences",
            count: n_stop as u64,
            max: MAX_STOP_SEQUENCES.into(),
        });
    }
    let mut stop_sequences = Vec::with_capacity(n_stop);
    for _ in 0..n_stop {
        stop_sequences.push(r.str("stop_sequences")?);
    }
    let prompt = match kind {
        0 => PromptRef::Text(r.str("prompt")?),
        1 => {
            // Each message takes at least 5 bytes, so the count is bounded by the payload.
            let n = r.count("messages", 5)?;
            let mut msgs = Vec::with_capacity(n);
            for _ in 0..n {
                let role = match r.u8("role")? {
                    0 => ChatRole::System,
                    1 => ChatRole::User,
                    2 => ChatRole::Assistant,
                    v => return Err(r.invalid("role", v.into())),
                };
                msgs.push(ChatMessageRef {
                    role,
                    content: r.str("content")?,
                });
            }
            PromptRef::Chat(msgs)
        }
        _ => PromptRef::TokenIds(r.ids("token_ids")?),
    };
    Ok(RequestFrame {
        model,
        max_tokens,
        priority,
        stream_buffer_size,
        sampling,
        stop_sequences,
        cache_strategy,
        prompt,
    })
}

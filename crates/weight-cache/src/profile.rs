//! Access profiles: per-block touch counts, saved as a versioned, checksummed file.
//!
//! File layout (little-endian): magic `ZLWCPROF`, `u32` version (1), `u32` block size, `u64` model
//! file length, `u32` crc32 of the model header, `u64` requests, `u64` tokens, `u64` block count,
//! then per block `u64` touches and `u64` requests that touched it, then a crc32 of all preceding
//! bytes.

use std::io;
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"ZLWCPROF";
const VERSION: u32 = 1;
const FIXED: usize = 8 + 4 + 4 + 8 + 4 + 8 + 8 + 8;

/// Error of [`AccessProfile::decode`] / [`AccessProfile::load`] and the cache's profile loading.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProfileError {
    /// The profile file could not be read or written.
    #[error("profile {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Not a profile file.
    #[error("not a weight-cache profile (bad magic)")]
    BadMagic,
    /// A profile version this build does not read.
    #[error("unsupported profile version {version} (supported: {VERSION})")]
    UnsupportedVersion {
        /// The version field.
        version: u32,
    },
    /// The file length does not match its declared block count.
    #[error("profile is {got} bytes, its header implies {expected}")]
    LengthMismatch {
        /// Length implied by the header (saturated).
        expected: u64,
        /// Actual length.
        got: usize,
    },
    /// The checksum does not match: the file is corrupt.
    #[error("profile checksum {stored:#010x} does not match the content ({computed:#010x})")]
    Checksum {
        /// Stored crc32.
        stored: u32,
        /// Computed crc32.
        computed: u32,
    },
    /// The profile was made for another model file or block size.
    #[error("profile is for another model or layout: {what} is {found}, expected {expected}")]
    Foreign {
        /// Which field differs.
        what: &'static str,
        /// The profile's value.
        found: u64,
        /// This cache's value.
        expected: u64,
    },
}

/// Per-block access counts of a model file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AccessProfile {
    /// Block size the counts refer to.
    pub block_size: u32,
    /// Length of the model file.
    pub file_len: u64,
    /// crc32 of the model file's header (identifies the model).
    pub header_crc: u32,
    /// Requests recorded.
    pub n_requests: u64,
    /// Tokens (forward steps) recorded.
    pub n_tokens: u64,
    /// Touches per block.
    pub touches: Vec<u64>,
    /// Number of requests that touched each block.
    pub requests: Vec<u64>,
}

impl AccessProfile {
    /// Blocks ranked hottest first: by requests touching them, then touches, then lower index (so
    /// the order is deterministic). Blocks never touched are not included.
    pub fn ranked(&self) -> Vec<usize> {
        let mut v: Vec<usize> = (0..self.touches.len())
            .filter(|&b| self.touches[b] > 0 || self.requests[b] > 0)
            .collect();
        v.sort_by(|&a, &b| {
            (self.requests[b], self.touches[b])
                .cmp(&(self.requests[a], self.touches[a]))
                .then(a.cmp(&b))
        });
        v
    }

    /// Encode to the file format.
    pub fn encode(&self) -> Vec<u8> {
        let n = self.touches.len().min(self.requests.len());
        let mut out = Vec::with_capacity(FIXED + n * 16 + 4);
        out.extend(MAGIC);
        out.extend(VERSION.to_le_bytes());
        out.extend(self.block_size.to_le_bytes());
        out.extend(self.file_len.to_le_bytes());
        out.extend(self.header_crc.to_le_bytes());
        out.extend(self.n_requests.to_le_bytes());
        out.extend(self.n_tokens.to_le_bytes());
        out.extend((n as u64).to_le_bytes());
        for b in 0..n {
            out.extend(self.touches[b].to_le_bytes());
            out.extend(self.requests[b].to_le_bytes());
        }
        let crc = crc32fast::hash(&out);
        out.extend(crc.to_le_bytes());
        out
    }

    /// Decode and verify (magic, version, length, checksum).
    pub fn decode(bytes: &[u8]) -> Result<Self, ProfileError> {
        if bytes.len() < 8 || &bytes[..8] != MAGIC {
            return Err(ProfileError::BadMagic);
        }
        if bytes.len() < FIXED + 4 {
            return Err(ProfileError::LengthMismatch {
                expected: (FIXED + 4) as u64,
                got: bytes.len(),
            });
        }
        let u32_at = |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().unwrap_or([0; 4]));
        let u64_at = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().unwrap_or([0; 8]));
        let version = u32_at(8);
        if version != VERSION {
            return Err(ProfileError::UnsupportedVersion { version });
        }
        let n = u64_at(FIXED - 8);
        let expected = n.saturating_mul(16).saturating_add((FIXED + 4) as u64);
        if expected != bytes.len() as u64 {
            return Err(ProfileError::LengthMismatch {
                expected,
                got: bytes.len(),
            });
        }
        let body = bytes.len() - 4;
        let stored = u32_at(body);
        let computed = crc32fast::hash(&bytes[..body]);
        if stored != computed {
            return Err(ProfileError::Checksum { stored, computed });
        }
        let n = n as usize;
        let (mut touches, mut requests) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for b in 0..n {
            touches.push(u64_at(FIXED + 16 * b));
            requests.push(u64_at(FIXED + 16 * b + 8));
        }
        Ok(Self {
            block_size: u32_at(12),
            file_len: u64_at(16),
            header_crc: u32_at(24),
            n_requests: u64_at(28),
            n_tokens: u64_at(36),
            touches,
            requests,
        })
    }

    /// Write to `path` atomically (temporary file + rename).
    pub fn save(&self, path: impl AsRef<Path>) -> Result<(), ProfileError> {
        let path = path.as_ref();
        let io_err = |source| ProfileError::Io {
            path: path.to_path_buf(),
            source,
        };
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, self.encode()).map_err(io_err)?;
        std::fs::rename(&tmp, path).map_err(io_err)
    }

    /// Read and verify a profile file (at most 1 GiB is read).
    pub fn load(path: impl AsRef<Path>) -> Result<Self, ProfileError> {
        use std::io::Read;
        let path = path.as_ref();
        let io_err = |source| ProfileError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut bytes = Vec::new();
        std::fs::File::open(path)
            .map_err(io_err)?
            .take(1 << 30)
            .read_to_end(&mut bytes)
            .map_err(io_err)?;
        Self::decode(&bytes)
    }
}

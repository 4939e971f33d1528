//! One member out of a wheel (a zip archive): the central directory is read from the end of the
//! file, the member's data is copied out stored or inflated. Only what wheels use: no zip64, no
//! encryption, methods 0 (stored) and 8 (deflate).

use std::io::{self, Read, Seek, SeekFrom, Write};

/// Why a member could not be read from a wheel.
#[derive(Debug, thiserror::Error)]
pub(crate) enum WheelError {
    /// Reading the archive or writing the member failed.
    #[error("reading the wheel: {0}")]
    Io(#[from] io::Error),
    /// The last 64 KiB hold no end-of-central-directory record.
    #[error("not a zip archive: no end-of-central-directory record in its last {searched} bytes")]
    NoEndRecord {
        /// Bytes searched from the end.
        searched: usize,
    },
    /// The central directory does not parse.
    #[error("malformed central directory at byte {offset}: {what}")]
    BadDirectory {
        /// Offset in the archive.
        offset: u64,
        /// What is wrong there.
        what: &'static str,
    },
    /// No central-directory entry has this name.
    #[error("the wheel has no member {name}")]
    MissingMember {
        /// The member looked for.
        name: String,
    },
    /// The member is compressed with a method other than stored or deflate.
    #[error("member {name} uses compression method {method} (stored and deflate are read)")]
    UnsupportedMethod {
        /// The member.
        name: String,
        /// Its zip compression method.
        method: u16,
    },
    /// The member's local header is not where the directory says.
    #[error("member {name}: no local header at byte {offset}")]
    BadLocalHeader {
        /// The member.
        name: String,
        /// Where the directory points.
        offset: u64,
    },
    /// The extracted size differs from the directory's.
    #[error("member {name}: {got} bytes extracted, the directory says {expected}")]
    SizeMismatch {
        /// The member.
        name: String,
        /// Size from the central directory.
        expected: u64,
        /// Bytes written.
        got: u64,
    },
}

const END_RECORD: u32 = 0x0605_4b50;
const DIRECTORY_ENTRY: u32 = 0x0201_4b50;
const LOCAL_HEADER: u32 = 0x0403_4b50;
const END_RECORD_LEN: usize = 22;
const DIRECTORY_ENTRY_LEN: usize = 46;
const LOCAL_HEADER_LEN: usize = 30;

/// Where a member's data is and how it is stored.
#[derive(Debug)]
struct Entry {
    method: u16,
    compressed: u64,
    size: u64,
    local_header: u64,
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// Copies member `name` of the zip archive `zip` to `out`; returns its size in bytes.
pub(crate) fn extract_member(
    zip: &mut (impl Read + Seek),
    name: &str,
    out: &mut impl Write,
) -> Result<u64, WheelError> {
    let entry = find_entry(zip, name)?;
    zip.seek(SeekFrom::Start(entry.local_header))?;
    let mut header = [0u8; LOCAL_HEADER_LEN];
    zip.read_exact(&mut header)?;
    let bad_header = || WheelError::BadLocalHeader {
        name: name.to_owned(),
        offset: entry.local_header,
    };
    if u32_at(&header, 0) != Some(LOCAL_HEADER) {
        return Err(bad_header());
    }
    let skip = u64::from(u16_at(&header, 26).ok_or_else(bad_header)?)
        + u64::from(u16_at(&header, 28).ok_or_else(bad_header)?);
    zip.seek(SeekFrom::Current(
        i64::try_from(skip).map_err(|_| bad_header())?,
    ))?;
    let data = zip.take(entry.compressed);
    let got = match entry.method {
        0 => io::copy(&mut { data }, out)?,
        8 => io::copy(&mut flate2::read::DeflateDecoder::new(data), out)?,
        method => {
            return Err(WheelError::UnsupportedMethod {
                name: name.to_owned(),
                method,
            });
        }
    };
    if got != entry.size {
        return Err(WheelError::SizeMismatch {
            name: name.to_owned(),
            expected: entry.size,
            got,
        });
    }
    Ok(got)
}

/// The central-directory entry named `name`.
fn find_entry(zip: &mut (impl Read + Seek), name: &str) -> Result<Entry, WheelError> {
    let len = zip.seek(SeekFrom::End(0))?;
    let tail_len = len.min((END_RECORD_LEN + usize::from(u16::MAX)) as u64);
    zip.seek(SeekFrom::Start(len - tail_len))?;
    let mut tail = vec![0u8; tail_len as usize];
    zip.read_exact(&mut tail)?;
    let end = (0..=tail.len().saturating_sub(END_RECORD_LEN))
        .rev()
        .find(|&i| u32_at(&tail, i) == Some(END_RECORD))
        .ok_or(WheelError::NoEndRecord {
            searched: tail.len(),
        })?;
    let end_offset = len - tail_len + end as u64;
    let bad = |what| WheelError::BadDirectory {
        offset: end_offset,
        what,
    };
    let dir_len = u32_at(&tail, end + 12).ok_or_else(|| bad("truncated end record"))?;
    let dir_offset = u32_at(&tail, end + 16).ok_or_else(|| bad("truncated end record"))?;
    if u64::from(dir_offset) + u64::from(dir_len) > end_offset {
        return Err(bad(
            "the directory extends past its end record (zip64 is not read)",
        ));
    }
    zip.seek(SeekFrom::Start(u64::from(dir_offset)))?;
    let mut dir = vec![0u8; dir_len as usize];
    zip.read_exact(&mut dir)?;
    let mut at = 0;
    while at + DIRECTORY_ENTRY_LEN <= dir.len() {
        let bad = |what| WheelError::BadDirectory {
            offset: u64::from(dir_offset) + at as u64,
            what,
        };
        if u32_at(&dir, at) != Some(DIRECTORY_ENTRY) {
            return Err(bad("no entry signature"));
        }
        let field16 = |off| u16_at(&dir, at + off).map(usize::from);
        let field32 = |off| u32_at(&dir, at + off).map(u64::from);
        let (Some(method), Some(compressed), Some(size)) = (field16(10), field32(20), field32(24))
        else {
            return Err(bad("truncated entry"));
        };
        let (Some(name_len), Some(extra_len), Some(comment_len), Some(local_header)) =
            (field16(28), field16(30), field16(32), field32(42))
        else {
            return Err(bad("truncated entry"));
        };
        let name_at = at + DIRECTORY_ENTRY_LEN;
        let entry_name = dir
            .get(name_at..name_at + name_len)
            .ok_or_else(|| bad("name runs past the directory"))?;
        if entry_name == name.as_bytes() {
            return Ok(Entry {
                method: method as u16,
                compressed,
                size,
                local_header,
            });
        }
        at = name_at + name_len + extra_len + comment_len;
    }
    Err(WheelError::MissingMember {
        name: name.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use std::io::Cursor;

    use super::*;

    /// A zip archive of `(name, data, deflated)` members, written as Python's zipfile does
    /// (local headers, then the central directory, then the end record).
    fn zip_of(members: &[(&str, &[u8], bool)]) -> Vec<u8> {
        let (mut out, mut dir) = (Vec::new(), Vec::new());
        for &(name, data, deflated) in members {
            let stored = if deflated {
                let mut e = flate2::write::DeflateEncoder::new(Vec::new(), Default::default());
                e.write_all(data).unwrap();
                e.finish().unwrap()
            } else {
                data.to_vec()
            };
            let method: u16 = if deflated { 8 } else { 0 };
            let offset = out.len() as u32;
            let sizes = |v: &mut Vec<u8>| {
                v.extend_from_slice(&0u32.to_le_bytes()); // crc32 (not checked)
                v.extend_from_slice(&(stored.len() as u32).to_le_bytes());
                v.extend_from_slice(&(data.len() as u32).to_le_bytes());
                v.extend_from_slice(&(name.len() as u16).to_le_bytes());
                v.extend_from_slice(&0u16.to_le_bytes()); // extra
            };
            out.extend_from_slice(&LOCAL_HEADER.to_le_bytes());
            out.extend_from_slice(&[20, 0, 0, 0]);
            out.extend_from_slice(&method.to_le_bytes());
            out.extend_from_slice(&[0; 4]);
            sizes(&mut out);
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(&stored);
            dir.extend_from_slice(&DIRECTORY_ENTRY.to_le_bytes());
            dir.extend_from_slice(&[20, 0, 20, 0, 0, 0]);
            dir.extend_from_slice(&method.to_le_bytes());
            dir.extend_from_slice(&[0; 4]);
            sizes(&mut dir);
            dir.extend_from_slice(&[0; 10]); // comment len, disk, internal and external attributes
            dir.extend_from_slice(&offset.to_le_bytes());
            dir.extend_from_slice(name.as_bytes());
        }
        let dir_offset = out.len() as u32;
        out.extend_from_slice(&dir);
        out.extend_from_slice(&END_RECORD.to_le_bytes());
        out.extend_from_slice(&[0; 4]);
        let n = members.len() as u16;
        out.extend_from_slice(&n.to_le_bytes());
        out.extend_from_slice(&n.to_le_bytes());
        out.extend_from_slice(&(dir.len() as u32).to_le_bytes());
        out.extend_from_slice(&dir_offset.to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out
    }

    fn extract(zip: &[u8], name: &str) -> Result<Vec<u8>, WheelError> {
        let mut out = Vec::new();
        extract_member(&mut Cursor::new(zip), name, &mut out)?;
        Ok(out)
    }

    #[test]
    fn stored_and_deflated_members_come_out_whole() {
        let big: Vec<u8> = (0..100_000u32)
            .flat_map(|i| (i % 251).to_le_bytes())
            .collect();
        let zip = zip_of(&[
            ("pkg/__init__.py", b"", false),
            ("pkg/model.gguf", &big, true),
            ("pkg/README", b"plain text", false),
        ]);
        assert_eq!(extract(&zip, "pkg/model.gguf").unwrap(), big);
        assert_eq!(extract(&zip, "pkg/README").unwrap(), b"plain text");
    }

    #[test]
    fn a_missing_member_is_named() {
        let zip = zip_of(&[("a", b"1", false)]);
        match extract(&zip, "b") {
            Err(WheelError::MissingMember { name }) => assert_eq!(name, "b"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_truncated_archive_is_an_error_not_a_panic() {
        let zip = zip_of(&[("pkg/model.gguf", &[7u8; 5000], true)]);
        for cut in [0, 10, zip.len() / 2, zip.len() - 30, zip.len() - 1] {
            assert!(
                extract(&zip[..cut], "pkg/model.gguf").is_err(),
                "cut at {cut}"
            );
        }
        let mut corrupt = zip.clone();
        let n = corrupt.len();
        corrupt[n - 6..n - 2].copy_from_slice(&0u32.to_le_bytes()); // directory offset 0
        assert!(extract(&corrupt, "pkg/model.gguf").is_err());
    }
}

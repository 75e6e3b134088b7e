//! The frame format on a link: a fixed header, then the payload.
//!
//! `magic "SHCL" | kind u8 | 3 zero bytes | op u64 | length u32 | checksum u32`, little
//! endian, then `length` payload bytes. The checksum (FNV-1a of the payload) catches a
//! stream that lost its framing; anything unexpected is a `Garbage` error naming the peer.

use std::io::{Read, Write};

pub(crate) const MAGIC: [u8; 4] = *b"SHCL";
pub(crate) const HEADER_BYTES: usize = 24;
/// The largest payload a frame may carry (a bound on what a garbage length can allocate).
pub const MAX_FRAME_BYTES: usize = 1 << 30;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Kind {
    Hello = 1,
    Data = 2,
    Heartbeat = 3,
    Close = 4,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Self::Hello,
            2 => Self::Data,
            3 => Self::Heartbeat,
            4 => Self::Close,
            _ => return None,
        })
    }
}

#[derive(Debug)]
pub(crate) struct Frame {
    pub kind: Kind,
    pub op: u64,
    pub payload: Vec<u8>,
}

pub(crate) fn checksum(data: &[u8]) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for &b in data {
        h ^= b as u32;
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

pub(crate) fn write_frame(
    w: &mut impl Write,
    kind: Kind,
    op: u64,
    payload: &[u8],
) -> std::io::Result<()> {
    let mut header = [0u8; HEADER_BYTES];
    header[0..4].copy_from_slice(&MAGIC);
    header[4] = kind as u8;
    header[8..16].copy_from_slice(&op.to_le_bytes());
    header[16..20].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    header[20..24].copy_from_slice(&checksum(payload).to_le_bytes());
    // One write for small frames: with TCP_NODELAY, two writes could be two packets.
    if payload.len() <= 4096 {
        let mut buf = Vec::with_capacity(HEADER_BYTES + payload.len());
        buf.extend_from_slice(&header);
        buf.extend_from_slice(payload);
        w.write_all(&buf)?;
    } else {
        w.write_all(&header)?;
        w.write_all(payload)?;
    }
    w.flush()
}

/// Why a frame could not be read.
#[derive(Debug)]
pub(crate) enum ReadError {
    Io(std::io::Error),
    Closed,
    Garbage(String),
}

pub(crate) fn read_frame(r: &mut impl Read) -> Result<Frame, ReadError> {
    let mut header = [0u8; HEADER_BYTES];
    match r.read_exact(&mut header) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Err(ReadError::Closed),
        Err(e) => return Err(ReadError::Io(e)),
    }
    if header[0..4] != MAGIC {
        return Err(ReadError::Garbage(format!(
            "bad magic {:02x?}",
            &header[0..4]
        )));
    }
    let kind = Kind::from_u8(header[4])
        .ok_or_else(|| ReadError::Garbage(format!("unknown frame kind {}", header[4])))?;
    if header[5..8] != [0, 0, 0] {
        return Err(ReadError::Garbage("nonzero reserved bytes".into()));
    }
    let op = u64::from_le_bytes(header[8..16].try_into().unwrap_or_default());
    let len = u32::from_le_bytes(header[16..20].try_into().unwrap_or_default()) as usize;
    let sum = u32::from_le_bytes(header[20..24].try_into().unwrap_or_default());
    if len > MAX_FRAME_BYTES {
        return Err(ReadError::Garbage(format!(
            "frame of {len} bytes is too large"
        )));
    }
    let mut payload = vec![0u8; len];
    match r.read_exact(&mut payload) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            return Err(ReadError::Garbage(format!(
                "truncated frame: connection closed inside a {len}-byte payload"
            )));
        }
        Err(e) => return Err(ReadError::Io(e)),
    }
    if checksum(&payload) != sum {
        return Err(ReadError::Garbage("payload checksum mismatch".into()));
    }
    Ok(Frame { kind, op, payload })
}

/// Little-endian bytes of `values`.
pub fn f32s_to_bytes(values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * 4);
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// The inverse of [`f32s_to_bytes`]; a length that is not a multiple of 4 is an error.
pub fn f32s_from_bytes(bytes: &[u8]) -> Result<Vec<f32>, String> {
    if !bytes.len().is_multiple_of(4) {
        return Err(format!(
            "{} bytes is not a whole number of f32 values",
            bytes.len()
        ));
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

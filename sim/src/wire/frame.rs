//! Frames: one message a frame, its body in postcard's compact binary form, prefixed by
//! its length (u32, big endian); and where the source host listens.
//!
//! The body's encoding costs CPU and nothing else: turmoil delivers a write as one
//! segment whatever its length (latency is drawn per segment, and a socket's capacity is
//! counted in segments), so a smaller frame changes no simulated timing. With JSON, the
//! encoding and decoding of frames (every value and payload a list of numbers) took about
//! a seventh of a seed's CPU.

use std::time::Duration;

use bytes::BufMut;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use turmoil::net::TcpStream;

/// The port the source host listens on.
pub const PORT: u16 = 7000;

/// Frames larger than this are refused (a corrupt length must not allocate gigabytes).
const MAX_FRAME: u32 = 16 * 1024 * 1024;

/// The room a frame is written into at first (most messages fit).
const FRAME_CAPACITY: usize = 128;

/// How much a read asks the stream for at most.
const READ_CHUNK: usize = 8192;

/// How often an idle streaming connection sends a heartbeat.
pub const HEARTBEAT: Duration = Duration::from_millis(500);
/// How long a client waits for any frame before it declares the link dead.
pub const READ_TIMEOUT: Duration = Duration::from_secs(2);

/// The body of a frame: `msg` in the wire's encoding.
pub fn encode<T: Serialize>(msg: &T) -> std::io::Result<Vec<u8>> {
    postcard::to_allocvec(msg).map_err(std::io::Error::other)
}

/// Reads a frame's body.
fn decode<'de, T: Deserialize<'de>>(body: &'de [u8]) -> std::io::Result<T> {
    postcard::from_bytes(body).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// Writes one frame in one write, as a client that buffers its frames does: one segment
/// on the simulated network, where a length and a body written apart were two, each
/// delivered (and each waking the reader) on its own.
pub async fn write<T: Serialize>(stream: &mut TcpStream, msg: &T) -> std::io::Result<()> {
    // Room for most messages up front: growing the frame from four bytes reallocated it
    // several times per write.
    let mut head = Vec::with_capacity(FRAME_CAPACITY);
    head.extend_from_slice(&[0u8; 4]);
    let frame = postcard::to_extend(msg, head).map_err(std::io::Error::other)?;
    let len = u32::try_from(frame.len() - 4).map_err(std::io::Error::other)?;
    let mut frame = frame;
    frame[..4].copy_from_slice(&len.to_be_bytes());
    stream.write_all(&frame).await?;
    stream.flush().await
}

/// Reads frames from a stream, cancel-safely: bytes read before a caller gave up (a
/// `select!` took another branch) stay buffered for the next call, so the stream never
/// loses its place in the framing.
#[derive(Debug)]
pub struct FrameReader {
    stream: TcpStream,
    buf: Vec<u8>,
    /// How long a read waits without a byte before it gives up.
    timeout: Duration,
}

impl FrameReader {
    /// Reads frames from `stream`, each read given up after [`READ_TIMEOUT`] without a
    /// byte.
    #[must_use]
    pub fn new(stream: TcpStream) -> Self {
        Self::with_timeout(stream, READ_TIMEOUT)
    }

    /// Reads frames from `stream`, each read given up after `timeout` without a byte.
    #[must_use]
    pub fn with_timeout(stream: TcpStream, timeout: Duration) -> Self {
        FrameReader {
            stream,
            buf: Vec::new(),
            timeout,
        }
    }

    /// The stream, for writing.
    pub fn stream(&mut self) -> &mut TcpStream {
        &mut self.stream
    }

    /// Reads one frame, giving up after the reader's timeout without a byte.
    pub async fn read<T: for<'de> Deserialize<'de>>(&mut self) -> std::io::Result<T> {
        loop {
            if let Some(end) = self.frame_end()? {
                let msg = decode(&self.buf[4..end]);
                self.buf.drain(..end);
                return msg;
            }
            // Read straight into the buffer's spare room (a zeroed chunk copied over cost
            // a memset of 8 KiB per read). `read_buf` through a `Limit` asks for at most
            // `READ_CHUNK` bytes, as the chunk did; a single read is cancel-safe: either it
            // returned bytes (kept) or nothing.
            self.buf.reserve(READ_CHUNK);
            let mut room = (&mut self.buf).limit(READ_CHUNK);
            let n = match tokio::time::timeout(self.timeout, self.stream.read_buf(&mut room)).await
            {
                Ok(r) => r?,
                Err(_) => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "no frame within the read timeout",
                    ));
                }
            };
            if n == 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "connection closed",
                ));
            }
        }
    }

    /// Where the first whole frame buffered ends, if one is.
    fn frame_end(&self) -> std::io::Result<Option<usize>> {
        let Some(len) = self.buf.get(..4) else {
            return Ok(None);
        };
        let len = u32::from_be_bytes([len[0], len[1], len[2], len[3]]);
        if len > MAX_FRAME {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "frame too large",
            ));
        }
        let end = 4 + len as usize;
        Ok((self.buf.len() >= end).then_some(end))
    }
}

/// Reads one frame, waiting as long as it takes (the server, waiting for a request).
pub async fn read_untimed<T: for<'de> Deserialize<'de>>(
    stream: &mut TcpStream,
) -> std::io::Result<T> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).await?;
    let len = u32::from_be_bytes(len);
    if len > MAX_FRAME {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "frame too large",
        ));
    }
    let mut buf = vec![0u8; len as usize];
    stream.read_exact(&mut buf).await?;
    decode(&buf)
}

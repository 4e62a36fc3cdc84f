//! Strangers at a job's ports: a process that is not a rank connects and sends garbage, an
//! HTTP request or a Flotilla frame cut short, then hangs up.
#![allow(dead_code)]

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// What a stranger sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stranger {
    /// 4 KiB of random bytes.
    RandomBytes,
    /// `GET / HTTP/1.1` with a host header.
    Http,
    /// A valid-looking 32-byte frame header (magic 0xF1, version 2, control channel)
    /// announcing a 1024-byte payload, then 100 bytes of it.
    TruncatedFrame,
}

impl Stranger {
    /// Every kind.
    pub const ALL: [Stranger; 3] = [
        Stranger::RandomBytes,
        Stranger::Http,
        Stranger::TruncatedFrame,
    ];

    /// How the table names it.
    pub fn name(self) -> &'static str {
        match self {
            Stranger::RandomBytes => "stranger: 4 KiB random bytes",
            Stranger::Http => "stranger: HTTP GET /",
            Stranger::TruncatedFrame => "stranger: truncated frame",
        }
    }

    /// The bytes sent; `seed` makes the random ones.
    pub fn payload(self, seed: u64) -> Vec<u8> {
        match self {
            Stranger::RandomBytes => {
                let mut rng = SplitMix(seed);
                (0..4096).map(|_| rng.next() as u8).collect()
            }
            Stranger::Http => b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: */*\r\n\r\n".to_vec(),
            Stranger::TruncatedFrame => {
                // See crates/flotilla-tcp/src/frame.rs: magic, version, channel, flags, op,
                // 3 reserved, group u64, seq u64, tag u32, len u32 (little endian).
                let mut b = vec![0xF1, 2, 0, 0, 0, 0, 0, 0];
                b.extend_from_slice(&0u64.to_le_bytes());
                b.extend_from_slice(&0u64.to_le_bytes());
                b.extend_from_slice(&0u32.to_le_bytes());
                b.extend_from_slice(&1024u32.to_le_bytes());
                b.extend(std::iter::repeat_n(0x5A, 100));
                b
            }
        }
    }

    /// Connects to 127.0.0.1:`port`, sends the payload and hangs up. `Err` if the port did
    /// not take the connection or the bytes (a port that closed meanwhile says so).
    pub fn visit(self, port: u16, seed: u64) -> std::io::Result<()> {
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
        s.set_write_timeout(Some(Duration::from_secs(2)))?;
        s.write_all(&self.payload(seed))?;
        s.flush()
    }
}

/// A small deterministic generator (SplitMix64): the suite's delays and random bytes, so
/// that a seed replays a run.
#[derive(Debug, Clone)]
pub struct SplitMix(pub u64);

impl SplitMix {
    /// The next 64 random bits.
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform value in `[lo, hi)`.
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

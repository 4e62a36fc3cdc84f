//! A connection's byte stream: plain TCP, or TCP wrapped in TLS ([`crate::tls`]).
//!
//! An enum rather than a trait object: the all-reduce hot path reads and writes through it,
//! and a plain stream costs one `match` per poll (no allocation, no dynamic call, no copy).
//! A plain stream splits into tokio's owned TCP halves as before; a TLS stream into
//! `tokio::io::split` halves (one session shared by the reader task and the writer).

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio_rustls::TlsStream;

/// A TLS session over TCP (boxed: it is large, and the plain variant should stay small).
pub(crate) type TlsTcp = Box<TlsStream<TcpStream>>;

/// An established connection to a peer: plain TCP, or TLS over TCP.
pub(crate) enum Stream {
    /// Plain TCP (no TLS configured).
    Plain(TcpStream),
    /// Mutual TLS over TCP.
    Tls(TlsTcp),
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = if self.is_tls() { "Tls" } else { "Plain" };
        f.debug_struct("Stream")
            .field("kind", &kind)
            .field("peer", &self.peer_addr().ok())
            .finish()
    }
}

impl Stream {
    fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Plain(s) => s,
            Stream::Tls(s) => s.get_ref().0,
        }
    }

    /// The peer's socket address.
    pub(crate) fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.tcp().peer_addr()
    }

    /// This end's socket address.
    pub(crate) fn local_addr(&self) -> io::Result<SocketAddr> {
        self.tcp().local_addr()
    }

    /// Whether the stream is encrypted.
    pub(crate) fn is_tls(&self) -> bool {
        matches!(self, Stream::Tls(_))
    }

    /// The stream as independent read and write halves (see [`ReadHalf::reunite`]).
    pub(crate) fn into_split(self) -> (ReadHalf, WriteHalf) {
        match self {
            Stream::Plain(s) => {
                let (r, w) = s.into_split();
                (ReadHalf::Plain(r), WriteHalf::Plain(w))
            }
            Stream::Tls(s) => {
                let peer = s.get_ref().0.peer_addr().ok();
                let (r, w) = tokio::io::split(s);
                (ReadHalf::Tls(r, peer), WriteHalf::Tls(w))
            }
        }
    }
}

/// The reading half of a [`Stream`].
pub(crate) enum ReadHalf {
    /// Of a plain TCP stream.
    Plain(OwnedReadHalf),
    /// Of a TLS stream, with the peer's address (taken before the split).
    Tls(tokio::io::ReadHalf<TlsTcp>, Option<SocketAddr>),
}

/// The writing half of a [`Stream`].
pub(crate) enum WriteHalf {
    /// Of a plain TCP stream.
    Plain(OwnedWriteHalf),
    /// Of a TLS stream.
    Tls(tokio::io::WriteHalf<TlsTcp>),
}

impl ReadHalf {
    /// The peer's socket address.
    pub(crate) fn peer_addr(&self) -> io::Result<SocketAddr> {
        match self {
            ReadHalf::Plain(r) => r.peer_addr(),
            ReadHalf::Tls(_, peer) => peer.ok_or_else(|| io::Error::other("peer address unknown")),
        }
    }

    /// Joins the halves of one [`Stream::into_split`] again; halves of different streams
    /// are an error (never a panic).
    pub(crate) fn reunite(self, w: WriteHalf) -> Result<Stream, &'static str> {
        const MISMATCH: &str = "mismatched stream halves";
        match (self, w) {
            (ReadHalf::Plain(r), WriteHalf::Plain(w)) => {
                r.reunite(w).map(Stream::Plain).map_err(|_| MISMATCH)
            }
            (ReadHalf::Tls(r, _), WriteHalf::Tls(w)) if r.is_pair_of(&w) => {
                Ok(Stream::Tls(r.unsplit(w)))
            }
            _ => Err(MISMATCH),
        }
    }
}

impl WriteHalf {
    /// Pushes out what a TLS session still buffers after a write (a plain socket buffers
    /// nothing in user space: no call at all). Every frame written through a `WriteHalf`
    /// must end with this, or its last bytes may wait in the session for the next frame.
    pub(crate) async fn push(&mut self) -> io::Result<()> {
        match self {
            WriteHalf::Plain(_) => Ok(()),
            WriteHalf::Tls(w) => w.flush().await,
        }
    }
}

/// Forwards the `AsyncRead` calls of an enum to its variants.
macro_rules! forward_read {
    ($ty:ident, $($variant:ident($inner:ident $(, $_rest:ident)?)),+) => {
        impl AsyncRead for $ty {
            #[inline]
            fn poll_read(
                self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                buf: &mut ReadBuf<'_>,
            ) -> Poll<io::Result<()>> {
                match self.get_mut() {
                    $($ty::$variant($inner $(, $_rest)?) => Pin::new($inner).poll_read(cx, buf),)+
                }
            }
        }
    };
}

/// Forwards the `AsyncWrite` calls of an enum to its variants.
macro_rules! forward_write {
    ($ty:ident, $($variant:ident),+) => {
        impl AsyncWrite for $ty {
            #[inline]
            fn poll_write(
                self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                buf: &[u8],
            ) -> Poll<io::Result<usize>> {
                match self.get_mut() {
                    $($ty::$variant(s) => Pin::new(s).poll_write(cx, buf),)+
                }
            }

            #[inline]
            fn poll_write_vectored(
                self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                bufs: &[io::IoSlice<'_>],
            ) -> Poll<io::Result<usize>> {
                match self.get_mut() {
                    $($ty::$variant(s) => Pin::new(s).poll_write_vectored(cx, bufs),)+
                }
            }

            #[inline]
            fn is_write_vectored(&self) -> bool {
                match self {
                    $($ty::$variant(s) => s.is_write_vectored(),)+
                }
            }

            #[inline]
            fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
                match self.get_mut() {
                    $($ty::$variant(s) => Pin::new(s).poll_flush(cx),)+
                }
            }

            #[inline]
            fn poll_shutdown(
                self: Pin<&mut Self>,
                cx: &mut Context<'_>,
            ) -> Poll<io::Result<()>> {
                match self.get_mut() {
                    $($ty::$variant(s) => Pin::new(s).poll_shutdown(cx),)+
                }
            }
        }
    };
}

forward_read!(Stream, Plain(s), Tls(s));
forward_read!(ReadHalf, Plain(s), Tls(s, _p));
forward_write!(Stream, Plain, Tls);
forward_write!(WriteHalf, Plain, Tls);

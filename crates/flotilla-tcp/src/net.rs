//! Socket setup: listeners and outgoing connections with the options the transport wants.

use std::net::SocketAddr;

use flotilla_group::CommError;
use tokio::net::{TcpListener, TcpSocket, TcpStream};

/// Binds a listener with `SO_REUSEADDR` and optional socket buffer sizes (inherited by
/// accepted sockets).
pub(crate) fn bind_listener(
    addr: SocketAddr,
    buf: Option<usize>,
) -> Result<TcpListener, CommError> {
    let ctx = || format!("cannot listen on {addr}");
    let sock = if addr.is_ipv4() {
        TcpSocket::new_v4()
    } else {
        TcpSocket::new_v6()
    }
    .map_err(|e| CommError::io(ctx(), e))?;
    sock.set_reuseaddr(true)
        .map_err(|e| CommError::io(ctx(), e))?;
    set_buffers(&sock, buf).map_err(|e| CommError::io(ctx(), e))?;
    sock.bind(addr).map_err(|e| CommError::io(ctx(), e))?;
    sock.listen(1024).map_err(|e| CommError::io(ctx(), e))
}

/// Connects to `addr` with `TCP_NODELAY` and optional socket buffer sizes.
pub(crate) async fn connect(addr: SocketAddr, buf: Option<usize>) -> std::io::Result<TcpStream> {
    let sock = if addr.is_ipv4() {
        TcpSocket::new_v4()
    } else {
        TcpSocket::new_v6()
    }?;
    set_buffers(&sock, buf)?;
    let stream = sock.connect(addr).await?;
    stream.set_nodelay(true)?;
    Ok(stream)
}

fn set_buffers(sock: &TcpSocket, buf: Option<usize>) -> std::io::Result<()> {
    if let Some(size) = buf {
        let size = u32::try_from(size).unwrap_or(u32::MAX);
        sock.set_send_buffer_size(size)?;
        sock.set_recv_buffer_size(size)?;
    }
    Ok(())
}

/// Resolves `host:port` to the first socket address.
pub(crate) async fn resolve(host: &str, port: u16) -> Result<SocketAddr, CommError> {
    let ctx = || format!("cannot resolve {host}:{port}");
    tokio::net::lookup_host((host, port))
        .await
        .map_err(|e| CommError::io(ctx(), e))?
        .next()
        .ok_or_else(|| CommError::io(ctx(), std::io::Error::other("no addresses")))
}

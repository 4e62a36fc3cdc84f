//! The rendezvous listener a launcher hands to rank 0. A launcher that picks the job's port
//! binds it itself and passes the listening socket down to rank 0 (its descriptor left open
//! across `exec`, its number in [`LISTEN_FD_ENV`]), so that the port is owned by the job from
//! the moment it is published: no other local process can take it between the launcher's
//! choice and rank 0's bind and pose as rank 0 (`flotilla launch` does this; see its
//! `rendezvous_socket`).

use std::net::TcpListener;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};

use rustix::io::{FdFlags, fcntl_setfd};
use rustix::net::{getsockname, sockopt};

/// The environment variable naming the descriptor of rank 0's listening socket.
pub const LISTEN_FD_ENV: &str = "FLOTILLA_LISTEN_FD";

/// Set once the listener was taken (or refused): a process takes it at most once.
static TAKEN: AtomicBool = AtomicBool::new(false);

/// The listener named by [`LISTEN_FD_ENV`], once per process, when it is an open TCP socket
/// listening on `port` (any port when `port` is 0). Anything else (no variable, a descriptor
/// that is not such a socket, one on another port) is left alone and `None` returned, with a
/// warning when the variable was set: rank 0 then binds its port itself.
pub(crate) fn take_listener(port: u16) -> Option<TcpListener> {
    let raw = std::env::var(LISTEN_FD_ENV).ok()?;
    if TAKEN.swap(true, Ordering::SeqCst) {
        return None;
    }
    let fd: RawFd = match raw.trim().parse() {
        Ok(fd) if fd > 2 => fd,
        _ => {
            tracing::warn!("{LISTEN_FD_ENV}={raw:?} is no descriptor number; ignored");
            return None;
        }
    };
    match check(fd, port) {
        Ok(()) => {
            // SAFETY: `check` saw `fd` open in this process's descriptor table and a listening
            // TCP socket; the launcher passed it to this process alone, nothing else in the
            // process refers to it (it is taken once, above), so this becomes its one owner.
            let owned = unsafe { OwnedFd::from_raw_fd(fd) };
            // Not inherited by this rank's own children.
            if let Err(e) = fcntl_setfd(&owned, FdFlags::CLOEXEC) {
                tracing::debug!(error = %e, "could not mark the inherited listener close-on-exec");
            }
            tracing::debug!(
                fd = owned.as_raw_fd(),
                port,
                "rank 0 took the launcher's listener"
            );
            Some(TcpListener::from(owned))
        }
        Err(why) => {
            tracing::warn!("{LISTEN_FD_ENV}={fd}: {why}; rank 0 binds its port itself");
            None
        }
    }
}

/// Whether `fd` is an open socket of this process listening on TCP `port` (0: any).
fn check(fd: RawFd, port: u16) -> Result<(), String> {
    // Safe test that the descriptor is open and a socket (Linux: "socket:[inode]").
    let link = std::fs::read_link(format!("/proc/self/fd/{fd}"))
        .map_err(|_| "no such open descriptor".to_owned())?;
    if !link.to_string_lossy().starts_with("socket:") {
        return Err(format!("not a socket ({})", link.display()));
    }
    // SAFETY: the descriptor is open (seen above) and stays open while borrowed: this function
    // neither closes it nor hands it on.
    let fd = unsafe { BorrowedFd::borrow_raw(fd) };
    if !sockopt::socket_acceptconn(fd).map_err(|e| e.to_string())? {
        return Err("the socket is not listening".into());
    }
    let addr = getsockname(fd).map_err(|e| e.to_string())?;
    let addr = std::net::SocketAddr::try_from(addr).map_err(|_| "not a TCP socket".to_owned())?;
    if port != 0 && addr.port() != port {
        return Err(format!(
            "listens on port {}, not the job's port {port}",
            addr.port()
        ));
    }
    Ok(())
}

//! The job's rendezvous port, owned from the moment it is published. The launcher of a local
//! job binds rank 0's listening socket itself (on the job's address, at the port asked for or
//! one the system picks) and hands it to rank 0 across `exec`
//! ([`flotilla_tcp::LISTEN_FD_ENV`]): no other local process can take the port between the
//! launcher's choice and rank 0's start and pose as rank 0, as it could when the launcher
//! found a free port, released it and let rank 0 bind it later.

use std::net::TcpListener;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::process::Command;

use anyhow::{Context, Result};
use flotilla_tcp::LISTEN_FD_ENV;
use flotilla_train::TrainConfig;

use crate::run_args::RunArgs;

/// Rank 0's listening socket, held by the launcher until rank 0 is started.
pub struct RendezvousSocket {
    listener: TcpListener,
}

impl RendezvousSocket {
    /// Binds `addr:port` (`port` 0: a free port the system picks) and listens.
    pub fn bind(addr: &str, port: u16) -> Result<RendezvousSocket> {
        let listener = TcpListener::bind((addr, port))
            .with_context(|| format!("binding the job's rendezvous port on {addr}:{port}"))?;
        Ok(RendezvousSocket { listener })
    }

    /// The port it listens on.
    pub fn port(&self) -> Result<u16> {
        Ok(self
            .listener
            .local_addr()
            .context("reading the rendezvous port")?
            .port())
    }

    /// The listening socket itself (an elastic job's lighthouse serves on it).
    pub fn into_listener(self) -> TcpListener {
        self.listener
    }

    /// Makes `cmd` (rank 0's) inherit the listening socket: the descriptor stays open across
    /// `exec` in that child alone, its number in [`LISTEN_FD_ENV`]. `self` must live until
    /// `cmd` is spawned.
    pub fn hand_to(&self, cmd: &mut Command) {
        let fd = self.listener.as_raw_fd();
        cmd.env(LISTEN_FD_ENV, fd.to_string());
        // SAFETY: the closure runs in the forked child before `exec`; it only calls fcntl, which
        // is async-signal-safe, on a descriptor number copied into it, and allocates nothing
        // (`last_os_error` reads errno into an `io::Error` without allocating).
        unsafe {
            cmd.pre_exec(move || {
                if libc::fcntl(fd, libc::F_SETFD, 0) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
}

/// Sets the job's rendezvous port: for a `local` job a socket bound now on the rendezvous
/// address (at `--master-port`, else at a port the system picks), which rank 0 inherits; for
/// ranks on other hosts `--master-port` if given, else 0: rank 0 binds a port the system picks
/// on its host and says it, and the launcher starts the other ranks with it
/// ([`crate::launch::inventory::Remote::start_running`]). Either way no port is published before
/// rank 0 holds it.
pub fn for_job(
    config: &mut TrainConfig,
    flags: &RunArgs,
    local: bool,
) -> Result<Option<RendezvousSocket>> {
    let given = flags.given("master-port");
    if !local {
        if !given {
            config.comm.master_port = 0;
        }
        return Ok(None);
    }
    let port = if given { config.comm.master_port } else { 0 };
    let socket = RendezvousSocket::bind(&config.comm.master_addr, port)?;
    config.comm.master_port = socket.port()?;
    Ok(Some(socket))
}

/// This host's address toward `host` (the source address its routes pick to reach it): where
/// processes on `host` reach a service of this host, such as an elastic job's lighthouse. A
/// UDP socket is connected, which sends nothing.
pub fn address_toward(host: &str) -> Result<String> {
    let socket = std::net::UdpSocket::bind(("0.0.0.0", 0)).context("a UDP socket")?;
    socket
        .connect((host, 9))
        .with_context(|| format!("no route from this host to {host}"))?;
    Ok(socket
        .local_addr()
        .context("its local address")?
        .ip()
        .to_string())
}

/// A port free on `addr` now, for a program that binds it itself later (torch's rendezvous
/// under `flotilla launch -- PROGRAM`, as under torchrun): bound, read and released, so
/// another local process could take it first, as with torchrun.
pub fn free_port(addr: &str) -> Result<u16> {
    RendezvousSocket::bind(addr, 0)?.port()
}

/// Where the ranks meet, for the launcher's first line: `ADDR:PORT`, or the address and that
/// rank 0 picks the port there (port 0).
pub fn describe(addr: &str, port: u16) -> String {
    if port == 0 {
        format!("{addr} (a port rank 0 picks there)")
    } else {
        format!("{addr}:{port}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_port_is_taken_from_bind_to_drop() -> Result<()> {
        let s = RendezvousSocket::bind("127.0.0.1", 0)?;
        let port = s.port()?;
        assert!(
            TcpListener::bind(("127.0.0.1", port)).is_err(),
            "a second bind"
        );
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "test -e /proc/self/fd/$FLOTILLA_LISTEN_FD"]);
        s.hand_to(&mut cmd);
        assert!(cmd.status()?.success(), "the child inherits the socket");
        drop(s);
        // The child that held it has ended: the port is free again.
        TcpListener::bind(("127.0.0.1", port))?;
        Ok(())
    }
}

//! The port rank 0 picked, said to whoever started it.
//!
//! A rank 0 configured with `master_port` 0 binds a port the system picks on its host and
//! prints [`PORT_ANNOUNCEMENT`] and the number, alone on a line of its standard error, once
//! it holds the listener. `flotilla launch --inventory` starts rank 0 so on its host, reads
//! the line ([`announced_port`]) and only then gives the other ranks the port: no moment
//! exists in which the port is published and nobody holds it (a local process could take
//! it and play rank 0).

/// The start of the line that says rank 0's rendezvous port.
pub const PORT_ANNOUNCEMENT: &str = "flotilla rank 0 rendezvous port: ";

/// Says `port` on standard error, on a line of its own.
pub(crate) fn announce(port: u16) {
    eprintln!("{PORT_ANNOUNCEMENT}{port}");
}

/// The port a line of rank 0's output announces, if it is the announcement.
pub fn announced_port(line: &str) -> Option<u16> {
    line.trim_end()
        .strip_prefix(PORT_ANNOUNCEMENT)?
        .parse()
        .ok()
        .filter(|&p| p != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_announcement_gives_a_port() {
        assert_eq!(
            announced_port(&format!("{PORT_ANNOUNCEMENT}41234")),
            Some(41234)
        );
        assert_eq!(
            announced_port(&format!("{PORT_ANNOUNCEMENT}41234\r")),
            Some(41234)
        );
        for other in [
            format!("{PORT_ANNOUNCEMENT}0"),
            format!("{PORT_ANNOUNCEMENT}70000"),
            format!("x {PORT_ANNOUNCEMENT}41234"),
            "rank 0 up".to_string(),
        ] {
            assert_eq!(announced_port(&other), None, "{other}");
        }
    }
}

//! How to reach an inventory host with the system OpenSSH client.
//!
//! [`SshTarget::from_host`] reads the Ansible variables Flotilla honours (the host's own, else
//! those of `[pool:vars]`):
//!
//! | variable | ssh |
//! |---|---|
//! | `ansible_host` (else the name without `:port`) | destination address |
//! | `ansible_user` | `user@` of the destination |
//! | `ansible_port` (else `name:port`) | `-p` |
//! | `ansible_ssh_private_key_file` | `-i` |
//! | `ansible_ssh_common_args`, `ansible_ssh_extra_args` | split by shell rules, passed as written |
//!
//! [`SshTarget::args`] puts the user's arguments first: for `-o` options ssh keeps the first
//! value it reads, so theirs win over Flotilla's defaults (`BatchMode=yes`, so a missing key
//! is an error instead of a password prompt that would hang the launcher;
//! `ConnectTimeout=15`; keep-alives that notice a dead host within a minute).

use std::path::PathBuf;

use crate::error::{ClusterError, Result};
use crate::inventory::{ANSIBLE_USER_VAR, Host};

/// Options Flotilla gives every ssh connection (after the user's own).
pub const DEFAULT_OPTIONS: [&str; 4] = [
    "BatchMode=yes",
    "ConnectTimeout=15",
    "ServerAliveInterval=15",
    "ServerAliveCountMax=4",
];

/// One host as the ssh client reaches it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SshTarget {
    /// The inventory name of the host (for messages).
    pub name: String,
    /// Address or DNS name to connect to.
    pub address: String,
    /// Remote user (`None`: ssh's default).
    pub user: Option<String>,
    /// Port (`None`: ssh's default).
    pub port: Option<u16>,
    /// Private key file.
    pub identity: Option<PathBuf>,
    /// The user's own arguments, in order.
    pub extra_args: Vec<String>,
}

impl SshTarget {
    /// Reads the host's Ansible variables.
    pub fn from_host(host: &Host) -> Result<SshTarget> {
        let bad = |var: &str, reason: String| ClusterError::HostVar {
            host: host.name().to_owned(),
            var: var.to_owned(),
            reason,
        };
        let port = match host.var("ansible_port") {
            Some(p) => Some(p.parse::<u16>().map_err(|_| {
                bad(
                    "ansible_port",
                    format!("`{p}` is not a port number (1-65535)"),
                )
            })?),
            None => host.inline_port(),
        };
        let mut extra_args = Vec::new();
        for var in ["ansible_ssh_common_args", "ansible_ssh_extra_args"] {
            if let Some(v) = host.var(var) {
                extra_args.extend(
                    shlex::split(v)
                        .ok_or_else(|| bad(var, format!("unbalanced quotes in `{v}`")))?,
                );
            }
        }
        // `Inventory::parse` refuses such hosts already; a host built otherwise is checked here.
        host.check_not_option()?;
        Ok(SshTarget {
            name: host.name().to_owned(),
            address: host.address().to_owned(),
            user: host.var(ANSIBLE_USER_VAR).map(str::to_owned),
            port,
            identity: host.var("ansible_ssh_private_key_file").map(PathBuf::from),
            extra_args,
        })
    }

    /// `user@address`, or the address alone.
    pub fn destination(&self) -> String {
        match &self.user {
            Some(u) => format!("{u}@{}", self.address),
            None => self.address.clone(),
        }
    }

    /// Everything that tells two targets apart: one entry per distinct login.
    pub fn login_key(&self) -> String {
        format!(
            "{}:{}:{:?}",
            self.destination(),
            self.port.unwrap_or(22),
            self.identity
        )
    }

    /// The arguments of `ssh` before the remote command: the user's, Flotilla's options,
    /// port, key, `--`, destination. The `--` ends ssh's options: a destination that begins
    /// with `-` is a host name to it, never an option (`-oProxyCommand=...`).
    pub fn args(&self) -> Vec<String> {
        let mut args = self.extra_args.clone();
        for opt in DEFAULT_OPTIONS {
            args.push("-o".to_owned());
            args.push(opt.to_owned());
        }
        if let Some(p) = self.port {
            args.push("-p".to_owned());
            args.push(p.to_string());
        }
        if let Some(key) = &self.identity {
            args.push("-i".to_owned());
            args.push(key.display().to_string());
        }
        args.push("--".to_owned());
        args.push(self.destination());
        args
    }
}

/// Quotes one word for a POSIX shell (the remote login shell runs what ssh sends).
pub fn quote(word: &str) -> Result<String> {
    shlex::try_quote(word)
        .map(|q| q.into_owned())
        .map_err(|_| ClusterError::Unquotable {
            word: word.replace('\0', "\\0"),
        })
}

/// Words joined into one shell command line, each quoted.
pub fn join(words: &[&str]) -> Result<String> {
    Ok(words
        .iter()
        .map(|w| quote(w))
        .collect::<Result<Vec<_>>>()?
        .join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ClusterError, Inventory};

    fn target(text: &str, i: usize) -> Result<SshTarget> {
        let inv = Inventory::parse(text, "hosts.ini")?;
        SshTarget::from_host(&inv.hosts()[i])
    }

    #[test]
    fn ansible_variables_become_ssh_arguments() -> Result<()> {
        let text = "[pool]\n\
            node1 ansible_host=10.0.0.1 ansible_port=2222 ansible_user=ubuntu \
            ansible_ssh_private_key_file=/keys/id ansible_ssh_common_args='-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null'\n\
            node2:2200\n\
            [pool:vars]\n\
            ansible_user=\"ops team\"\n";
        let t = target(text, 0)?;
        assert_eq!(
            t.args(),
            [
                "-o",
                "StrictHostKeyChecking=no",
                "-o",
                "UserKnownHostsFile=/dev/null",
                "-o",
                "BatchMode=yes",
                "-o",
                "ConnectTimeout=15",
                "-o",
                "ServerAliveInterval=15",
                "-o",
                "ServerAliveCountMax=4",
                "-p",
                "2222",
                "-i",
                "/keys/id",
                "--",
                "ubuntu@10.0.0.1",
            ]
        );
        // The group's user applies where the host sets none; the inline port is the port.
        let t = target(text, 1)?;
        assert_eq!(t.destination(), "ops team@node2");
        assert_eq!(t.port, Some(2200));
        assert_ne!(target(text, 0)?.login_key(), t.login_key());
        Ok(())
    }

    #[test]
    fn a_bad_port_names_host_and_variable() {
        let err = target("[pool]\nh1 ansible_port=ssh\n", 0).map(|_| ());
        assert_eq!(
            err.map_err(|e| e.to_string()),
            Err("host h1: ansible_port: `ssh` is not a port number (1-65535)".to_owned())
        );
    }

    #[test]
    fn a_host_or_user_that_ssh_would_read_as_an_option_is_refused() {
        for (text, what) in [
            ("[pool]\n-F/tmp/cfg\n", "address"),
            ("[pool]\nnode1 ansible_host=-oProxyCommand=x\n", "address"),
            ("[pool]\nnode1 ansible_user=-oProxyCommand=x\n", "user"),
            (
                "[pool]\nnode1\n[pool:vars]\nansible_user=-F/tmp/cfg\n",
                "user",
            ),
            ("-F/tmp/cfg:22\n", "address"),
        ] {
            let err = Inventory::parse(text, "hosts.ini").map(|_| ());
            let Err(e) = err else {
                panic!("{text:?} was accepted");
            };
            let e = e.to_string();
            assert!(
                e.starts_with("hosts.ini:") && e.contains(&format!("its {what} `-")),
                "{text:?}: {e}"
            );
        }
        // A host made by hand, not parsed, is refused when it becomes a target.
        let host = crate::inventory::Host::new("-oProxyCommand=touch");
        assert!(matches!(
            SshTarget::from_host(&host),
            Err(ClusterError::OptionLikeHost { .. })
        ));
        // A `-` inside a name is no option.
        assert!(target("[pool]\nnode-1 ansible_user=ops-team\n", 0).is_ok());
    }

    /// `--` ends ssh's options: OpenSSH reads the word after it as the destination, even one
    /// beginning with `-` (checked with `ssh -G`, which prints the configuration it would use
    /// without connecting; skipped without OpenSSH).
    #[test]
    fn the_destination_follows_a_double_dash_that_ssh_accepts() {
        let t = SshTarget {
            name: "n".into(),
            address: "node1".into(),
            user: Some("ops".into()),
            port: Some(2222),
            identity: None,
            extra_args: Vec::new(),
        };
        let args = t.args();
        assert_eq!(args[args.len() - 2..], ["--", "ops@node1"]);
        let Ok(out) = std::process::Command::new("ssh")
            .arg("-G")
            .args(&args)
            .arg("true")
            .output()
        else {
            eprintln!("SKIPPED: no ssh client");
            return;
        };
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        for line in ["user ops", "hostname node1", "port 2222", "batchmode yes"] {
            assert!(text.lines().any(|l| l == line), "no `{line}` in:\n{text}");
        }
        // After `--`, an option-like word is a (refused) host name, not an option.
        let out = std::process::Command::new("ssh")
            .args(["-G", "--", "-oProxyCommand=true", "true"])
            .output()
            .expect("ssh");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(!text.contains("proxycommand true"), "{text}");
    }

    #[test]
    fn remote_words_are_quoted() -> Result<()> {
        assert_eq!(
            join(&["cd", "/a b", "&&", "echo", "it's"])?,
            "cd '/a b' '&&' echo \"it's\""
        );
        assert!(quote("a\0b").is_err());
        Ok(())
    }
}

//! Host inventories: hcddl's Ansible-style ini (`[pool]` section) or a plain host list.
//!
//! ```text
//! # Ansible-style: only the hosts of [pool] are used, in order.
//! [pool]
//! 10.0.0.5 ansible_user=ubuntu
//! 10.0.0.6            ; other sections are ignored
//!
//! # Plain list: one host per line.
//! 10.0.0.5
//! node7:2222
//! ```
//!
//! The format is detected from the text: any line starting with `[` makes it an ini file.
//! Host strings are kept as written (trimmed), `host:port` included; the same host may be
//! listed more than once to run several processes on it.
//!
//! As in Ansible, a value may be quoted (`ansible_ssh_common_args='-o A=b -o C=d'`, single or
//! double quotes, shell rules), and the variables of `[pool:vars]` apply to every host of
//! `[pool]` that does not set them itself (wherever the section appears in the file).

use std::fs;
use std::path::Path;

use crate::error::{ClusterError, Result};

/// The ini section whose hosts Flotilla places roles on.
pub const POOL_SECTION: &str = "pool";

/// The section whose `key=value` lines apply to every host of [`POOL_SECTION`].
pub const POOL_VARS_SECTION: &str = "pool:vars";

/// The Ansible variable that gives a host alias its real address.
pub const ANSIBLE_HOST_VAR: &str = "ansible_host";

/// The Ansible variable that gives the remote user.
pub const ANSIBLE_USER_VAR: &str = "ansible_user";

/// Which syntax an inventory was written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InventoryFormat {
    /// Ansible-style ini with a `[pool]` section.
    Ini,
    /// One host per line.
    List,
}

/// One host of an inventory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Host {
    name: String,
    vars: Vec<(String, String)>,
    group_vars: Vec<(String, String)>,
    line: usize,
}

impl Host {
    /// A host with no variables, not read from a file (line 0).
    pub fn new(name: impl Into<String>) -> Host {
        Host {
            name: name.into(),
            vars: Vec::new(),
            group_vars: Vec::new(),
            line: 0,
        }
    }

    /// The host as written (an address, a name, or `host:port`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The `key=value` attributes written after the host, in order (ini format only).
    pub fn vars(&self) -> &[(String, String)] {
        &self.vars
    }

    /// The variables of `[pool:vars]`, in order (they apply where the host sets none).
    pub fn group_vars(&self) -> &[(String, String)] {
        &self.group_vars
    }

    /// The value of variable `key`: the host's own (the last one wins), else the group's.
    pub fn var(&self, key: &str) -> Option<&str> {
        last_value(&self.vars, key).or_else(|| last_value(&self.group_vars, key))
    }

    /// Where to reach the host: its `ansible_host` variable if set, else its name without a
    /// `:port` suffix.
    pub fn address(&self) -> &str {
        self.var(ANSIBLE_HOST_VAR)
            .unwrap_or_else(|| split_port(&self.name).0)
    }

    /// The port written as `name:port` (Ansible's way of giving the ssh port inline).
    pub fn inline_port(&self) -> Option<u16> {
        split_port(&self.name).1
    }

    /// Refuses a host whose address or user ssh would read as one of its options: a word
    /// that begins with `-` (`-oProxyCommand=...` runs a command on the launcher's machine).
    pub fn check_not_option(&self) -> Result<()> {
        let address = self.address();
        let user = self.var(ANSIBLE_USER_VAR).unwrap_or_default();
        let (what, word) = if address.starts_with('-') {
            ("address", address)
        } else if user.starts_with('-') {
            ("user", user)
        } else {
            return Ok(());
        };
        Err(ClusterError::OptionLikeHost {
            host: self.name.clone(),
            what,
            word: word.to_owned(),
        })
    }

    /// The 1-based line the host was read from; 0 if it was not read from a file.
    pub fn line(&self) -> usize {
        self.line
    }
}

/// The hosts available for placement, in the order listed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Inventory {
    source_name: String,
    format: InventoryFormat,
    hosts: Vec<Host>,
}

impl Inventory {
    /// Parses an inventory, detecting its format. `source_name` (usually the file name)
    /// appears in error messages.
    pub fn parse(text: &str, source_name: &str) -> Result<Inventory> {
        let is_ini = text.lines().any(|l| l.trim_start().starts_with('['));
        let (format, hosts) = if is_ini {
            (InventoryFormat::Ini, parse_ini(text, source_name)?)
        } else {
            (InventoryFormat::List, parse_list(text, source_name)?)
        };
        if let Some(host) = hosts.iter().find(|h| h.address().trim().is_empty()) {
            return Err(line_error(
                source_name,
                host.line,
                format!(
                    "host `{}` has no address (an empty name before `:port`, or an empty \
                     `{ANSIBLE_HOST_VAR}`)",
                    host.name
                ),
            ));
        }
        for host in &hosts {
            host.check_not_option()
                .map_err(|e| line_error(source_name, host.line, e.to_string()))?;
        }
        Ok(Inventory {
            source_name: source_name.to_owned(),
            format,
            hosts,
        })
    }

    /// Reads and parses the inventory file at `path`.
    pub fn load(path: impl AsRef<Path>) -> Result<Inventory> {
        let path = path.as_ref();
        let text = fs::read_to_string(path).map_err(|cause| ClusterError::Io {
            path: path.to_path_buf(),
            cause,
        })?;
        Inventory::parse(&text, &path.display().to_string())
    }

    /// An inventory of the given hosts, without attributes.
    pub fn from_hosts<I, S>(source_name: &str, hosts: I) -> Inventory
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Inventory {
            source_name: source_name.to_owned(),
            format: InventoryFormat::List,
            hosts: hosts.into_iter().map(Host::new).collect(),
        }
    }

    /// The name given at parse time (usually the file path).
    pub fn source_name(&self) -> &str {
        &self.source_name
    }

    /// The detected format.
    pub fn format(&self) -> InventoryFormat {
        self.format
    }

    /// The hosts, in the order listed.
    pub fn hosts(&self) -> &[Host] {
        &self.hosts
    }

    /// Number of hosts.
    pub fn len(&self) -> usize {
        self.hosts.len()
    }

    /// Whether no host is listed.
    pub fn is_empty(&self) -> bool {
        self.hosts.is_empty()
    }
}

/// The last value of `key` in `vars`.
fn last_value<'a>(vars: &'a [(String, String)], key: &str) -> Option<&'a str> {
    vars.iter()
        .rev()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

/// `host:port` into its parts; a name with no `:` (or with several, as an IPv6 address) has no
/// inline port.
fn split_port(name: &str) -> (&str, Option<u16>) {
    match name.split_once(':') {
        Some((host, port)) if !port.contains(':') => match port.parse() {
            Ok(p) => (host, Some(p)),
            Err(_) => (name, None),
        },
        _ => (name, None),
    }
}

/// Removes a `#` comment (hosts and addresses never contain `#`) and surrounding space.
fn strip_comment(line: &str) -> &str {
    line.split_once('#')
        .map_or(line, |(before, _)| before)
        .trim()
}

fn line_error(source_name: &str, line: usize, reason: String) -> ClusterError {
    ClusterError::InventoryLine {
        source_name: source_name.to_owned(),
        line,
        reason,
    }
}

/// Rejects host tokens that are plainly not one host.
fn check_host(token: &str, source_name: &str, line: usize) -> Result<()> {
    if token.contains(',') {
        return Err(line_error(
            source_name,
            line,
            format!("host `{token}` contains `,`: list one host per line"),
        ));
    }
    if token.contains('=') {
        return Err(line_error(
            source_name,
            line,
            format!("expected a host before `{token}`, found an attribute"),
        ));
    }
    Ok(())
}

fn parse_list(text: &str, source_name: &str) -> Result<Vec<Host>> {
    let mut hosts = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let token = strip_comment(raw);
        if token.is_empty() {
            continue;
        }
        if token.contains(char::is_whitespace) {
            return Err(line_error(
                source_name,
                line,
                format!(
                    "host `{token}` contains whitespace (one host per line; attributes need \
                     an ini inventory with a [pool] section)"
                ),
            ));
        }
        check_host(token, source_name, line)?;
        hosts.push(Host {
            name: token.to_owned(),
            vars: Vec::new(),
            group_vars: Vec::new(),
            line,
        });
    }
    Ok(hosts)
}

fn parse_ini(text: &str, source_name: &str) -> Result<Vec<Host>> {
    let mut sections: Vec<String> = Vec::new();
    let mut section = String::new();
    let mut hosts = Vec::new();
    let mut group_vars = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let content = strip_comment(raw);
        if content.is_empty() || content.starts_with(';') {
            continue;
        }
        if let Some(rest) = content.strip_prefix('[') {
            let name = rest
                .strip_suffix(']')
                .map(str::trim)
                .filter(|n| !n.is_empty())
                .ok_or_else(|| {
                    line_error(
                        source_name,
                        line,
                        format!("malformed section header `{content}`: expected `[name]`"),
                    )
                })?;
            if !sections.iter().any(|s| s == name) {
                sections.push(name.to_owned());
            }
            section = name.to_owned();
            continue;
        }
        if section == POOL_SECTION {
            hosts.push(parse_host_line(content, source_name, line)?);
        } else if section == POOL_VARS_SECTION {
            group_vars.push(parse_var_line(content, source_name, line)?);
        }
    }
    for host in &mut hosts {
        host.group_vars = group_vars.clone();
    }
    if !sections.iter().any(|s| s == POOL_SECTION) {
        return Err(ClusterError::NoPoolSection {
            source_name: source_name.to_owned(),
            sections: sections.iter().map(|s| format!("[{s}]")).collect(),
        });
    }
    Ok(hosts)
}

/// Splits a line into words by shell rules (Ansible reads ini values with them).
fn words(content: &str, source_name: &str, line: usize) -> Result<Vec<String>> {
    shlex::split(content).ok_or_else(|| {
        line_error(
            source_name,
            line,
            format!("unbalanced quotes or a trailing `\\` in `{content}`"),
        )
    })
}

/// `key=value` of a `[pool:vars]` line (the value may be quoted and contain spaces).
fn parse_var_line(content: &str, source_name: &str, line: usize) -> Result<(String, String)> {
    let words = words(content, source_name, line)?;
    match words.as_slice() {
        [one] => match one.split_once('=') {
            Some((key, value)) if !key.is_empty() => Ok((key.to_owned(), value.to_owned())),
            _ => Err(line_error(
                source_name,
                line,
                format!("expected `key=value` in [{POOL_VARS_SECTION}], found `{content}`"),
            )),
        },
        _ => Err(line_error(
            source_name,
            line,
            format!(
                "expected one `key=value` per line in [{POOL_VARS_SECTION}], found `{content}` \
                 (quote a value that has spaces)"
            ),
        )),
    }
}

/// `host [key=value ...]`; values may be quoted.
fn parse_host_line(content: &str, source_name: &str, line: usize) -> Result<Host> {
    let words = words(content, source_name, line)?;
    let mut tokens = words.iter().map(String::as_str);
    let name = tokens.next().unwrap_or_default();
    check_host(name, source_name, line)?;
    let mut vars = Vec::new();
    for token in tokens {
        match token.split_once('=') {
            Some((key, value)) if !key.is_empty() => vars.push((key.to_owned(), value.to_owned())),
            _ => {
                return Err(line_error(
                    source_name,
                    line,
                    format!(
                        "expected `key=value` after host `{name}`, found `{token}` \
                         (list one host per line)"
                    ),
                ));
            }
        }
    }
    Ok(Host {
        name: name.to_owned(),
        vars,
        group_vars: Vec::new(),
        line,
    })
}

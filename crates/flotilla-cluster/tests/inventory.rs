//! Parsing of `[pool]` ini inventories and plain host lists.

use flotilla_cluster::{ClusterError, Inventory, InventoryFormat};

fn names(inv: &Inventory) -> Vec<&str> {
    inv.hosts().iter().map(|h| h.name()).collect()
}

fn parse_error(text: &str) -> String {
    match Inventory::parse(text, "pool.ini") {
        Ok(inv) => panic!("expected an error, parsed {inv:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn ini_pool_with_attributes_and_comments() -> Result<(), ClusterError> {
    let text = "\
# cluster for the hierarchical run
ungrouped.example

[pool]
10.0.0.5 ansible_user=ubuntu
; a semicolon comment
10.0.0.6   ansible_user=ubuntu ansible_port=2222   # inline comment
node7 ansible_host=10.0.0.7

node8:2200
[monitoring]
grafana.example ansible_user=admin
[pool:vars]
ansible_python_interpreter=/usr/bin/python3
";
    let inv = Inventory::parse(text, "pool.ini")?;
    assert_eq!(inv.format(), InventoryFormat::Ini);
    assert_eq!(inv.source_name(), "pool.ini");
    assert_eq!(
        names(&inv),
        vec!["10.0.0.5", "10.0.0.6", "node7", "node8:2200"]
    );
    let h = &inv.hosts()[1];
    assert_eq!(
        h.vars(),
        &[
            ("ansible_user".to_owned(), "ubuntu".to_owned()),
            ("ansible_port".to_owned(), "2222".to_owned()),
        ]
    );
    assert_eq!(h.var("ansible_port"), Some("2222"));
    assert_eq!(h.line(), 7);
    assert_eq!(inv.hosts()[2].address(), "10.0.0.7");
    assert_eq!(inv.hosts()[0].address(), "10.0.0.5");
    Ok(())
}

#[test]
fn plain_list() -> Result<(), ClusterError> {
    let text = "# workers\n\n  10.0.0.1  \n10.0.0.2 # second\nhost-c:2222\n10.0.0.1\n";
    let inv = Inventory::parse(text, "hosts.txt")?;
    assert_eq!(inv.format(), InventoryFormat::List);
    assert_eq!(
        names(&inv),
        vec!["10.0.0.1", "10.0.0.2", "host-c:2222", "10.0.0.1"]
    );
    assert_eq!(inv.hosts()[2].line(), 5);
    assert_eq!(inv.len(), 4);
    assert!(Inventory::parse("# nothing\n\n", "empty.txt")?.is_empty());
    Ok(())
}

#[test]
fn ini_without_pool_names_the_sections() {
    let msg = parse_error("[workers]\na\nb\n[all:vars]\nx=1\n[workers]\nc\n");
    assert_eq!(
        msg,
        "pool.ini: no [pool] section (Flotilla places roles on the hosts of [pool]); \
         sections found: [workers], [all:vars]"
    );
}

#[test]
fn bad_lines_name_the_line() {
    assert_eq!(
        parse_error("10.0.0.1\n10.0.0.2 10.0.0.3\n"),
        "pool.ini:2: host `10.0.0.2 10.0.0.3` contains whitespace (one host per line; \
         attributes need an ini inventory with a [pool] section)"
    );
    assert_eq!(
        parse_error("[pool]\n10.0.0.1\n10.0.0.2 10.0.0.3\n"),
        "pool.ini:3: expected `key=value` after host `10.0.0.2`, found `10.0.0.3` \
         (list one host per line)"
    );
    assert_eq!(
        parse_error("[pool]\nansible_user=ubuntu\n"),
        "pool.ini:2: expected a host before `ansible_user=ubuntu`, found an attribute"
    );
    assert_eq!(
        parse_error("a,b\n"),
        "pool.ini:1: host `a,b` contains `,`: list one host per line"
    );
    assert_eq!(
        parse_error("# x\n[pool\nh\n"),
        "pool.ini:2: malformed section header `[pool`: expected `[name]`"
    );
    assert_eq!(
        parse_error("[]\nh\n"),
        "pool.ini:1: malformed section header `[]`: expected `[name]`"
    );
}

#[test]
fn load_reads_a_file() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("pool.ini");
    std::fs::write(&path, "[pool]\nh1\nh2\n")?;
    let inv = Inventory::load(&path)?;
    assert_eq!(names(&inv), vec!["h1", "h2"]);
    assert_eq!(inv.source_name(), path.display().to_string());
    let missing = dir.path().join("missing.ini");
    let msg = Inventory::load(&missing).err().map(|e| e.to_string());
    assert!(
        msg.as_deref()
            .is_some_and(|m| m.starts_with(&format!("cannot read inventory {}", missing.display()))),
        "{msg:?}"
    );
    Ok(())
}

#[test]
fn quoted_values_and_pool_vars() -> Result<(), ClusterError> {
    let text = "\
[pool:vars]
ansible_user=ubuntu
ansible_ssh_common_args='-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null'
[pool]
127.0.0.1 ansible_port=2222 ansible_user=\"root\"
127.0.0.1:2223
";
    let inv = Inventory::parse(text, "pool.ini")?;
    let (a, b) = (&inv.hosts()[0], &inv.hosts()[1]);
    assert_eq!(a.var("ansible_user"), Some("root"));
    assert_eq!(b.var("ansible_user"), Some("ubuntu"));
    assert_eq!(
        b.var("ansible_ssh_common_args"),
        Some("-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null")
    );
    assert_eq!((b.address(), b.inline_port()), ("127.0.0.1", Some(2223)));
    assert_eq!(
        parse_error("[pool]\nh1 ansible_ssh_common_args='-o A\n"),
        "pool.ini:2: unbalanced quotes or a trailing `\\` in `h1 ansible_ssh_common_args='-o A`"
    );
    assert_eq!(
        parse_error("[pool]\nh1\n[pool:vars]\na b\n"),
        "pool.ini:4: expected one `key=value` per line in [pool:vars], found `a b` (quote a value that has spaces)"
    );
    Ok(())
}

/// Fuzzing found: `:2222` (a port without a host) or an empty `ansible_host` gave a host
/// with an empty address.
#[test]
fn a_host_without_an_address_is_refused() {
    assert_eq!(
        parse_error("node1\n:2222\n"),
        "pool.ini:2: host `:2222` has no address (an empty name before `:port`, or an empty \
         `ansible_host`)"
    );
    assert!(
        parse_error("[pool]\nh ansible_host=\n").contains("pool.ini:2: host `h` has no address")
    );
    assert!(
        parse_error("[pool]\nh\n[pool:vars]\nansible_host=''\n")
            .contains("pool.ini:2: host `h` has no address")
    );
}

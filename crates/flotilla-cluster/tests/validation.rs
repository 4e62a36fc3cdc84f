//! Every validation error of a topology spec, and the key it names.

use flotilla_cluster::{Arch, ClusterError, Topology, TopologySpec};

/// Parses `yaml` and returns the message of the error `Topology::build` gives.
fn build_error(yaml: &str) -> String {
    match TopologySpec::from_yaml(yaml, "test.yaml").and_then(|spec| Topology::build(&spec)) {
        Ok(t) => panic!("expected an error for {yaml:?}, built {t:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn flat_without_parameter_server() {
    let msg = build_error("arch: flat\n");
    assert!(
        msg.starts_with("arch `flat` needs `parameter_server`"),
        "{msg}"
    );
}

#[test]
fn flat_with_global_server() {
    let msg = build_error(
        "arch: flat\nparameter_server: {aggr_type: sync, num_workers: 2}\n\
         global_server: {aggr_type: sync, local_servers: [{aggr_type: sync, num_workers: 1}]}\n",
    );
    assert_eq!(
        msg,
        "`global_server` is not allowed with arch `flat`: it belongs to arch `hierarchical`"
    );
}

#[test]
fn hierarchical_without_global_server() {
    let msg = build_error("arch: hierarchical\n");
    assert!(
        msg.starts_with("arch `hierarchical` needs `global_server`"),
        "{msg}"
    );
}

#[test]
fn hierarchical_with_parameter_server() {
    let msg = build_error(
        "arch: hierarchical\nparameter_server: {aggr_type: sync, num_workers: 2}\n\
         global_server: {aggr_type: sync, local_servers: [{aggr_type: sync, num_workers: 1}]}\n",
    );
    assert_eq!(
        msg,
        "`parameter_server` is not allowed with arch `hierarchical`: it belongs to arch `flat`"
    );
}

#[test]
fn hierarchical_without_local_servers() {
    let msg =
        build_error("arch: hierarchical\nglobal_server: {aggr_type: sync, local_servers: []}\n");
    assert_eq!(
        msg,
        "`global_server.local_servers` must list at least one local server"
    );
}

#[test]
fn zero_workers_names_the_key() {
    let msg = build_error("arch: flat\nparameter_server: {aggr_type: sync, num_workers: 0}\n");
    assert_eq!(
        msg,
        "`parameter_server.num_workers` must be at least 1, got 0"
    );
    let msg = build_error(
        "arch: hierarchical\nglobal_server:\n  aggr_type: sync\n  local_servers:\n\
         \x20   - {aggr_type: async, num_workers: 2}\n    - {type: async, num_workers: 0}\n",
    );
    assert_eq!(
        msg,
        "`global_server.local_servers[1].num_workers` must be at least 1, got 0"
    );
}

#[test]
fn zero_servers() {
    let msg = build_error(
        "arch: flat\nparameter_server: {aggr_type: sync, num_workers: 2}\nservers: 0\n",
    );
    assert_eq!(msg, "`servers` must be at least 1, got 0");
}

#[test]
fn sharded_hierarchical_is_not_supported_yet() {
    let msg = build_error(
        "arch: hierarchical\nservers: 2\n\
         global_server: {aggr_type: sync, local_servers: [{aggr_type: sync, num_workers: 1}]}\n",
    );
    assert!(
        msg.starts_with("`servers: 2` is not supported with arch `hierarchical` yet"),
        "{msg}"
    );
    assert!(msg.contains("only implemented for arch `flat`"), "{msg}");
}

#[test]
fn allreduce_with_ps_keys_says_to_set_arch() {
    let msg = build_error("parameter_server: {aggr_type: sync, num_workers: 2}\n");
    assert_eq!(
        msg,
        "`parameter_server` is set but arch is `allreduce` (the default when `arch` is absent): \
         set `arch: flat` to train with parameter servers, or remove `parameter_server`"
    );
    let msg = build_error(
        "arch: allreduce\nglobal_server: {aggr_type: sync, local_servers: [{aggr_type: sync, num_workers: 1}]}\n",
    );
    assert!(msg.contains("set `arch: hierarchical`"), "{msg}");
    let msg = build_error("servers: 3\n");
    assert!(
        msg.starts_with("`servers` is set but arch is `allreduce`"),
        "{msg}"
    );
}

#[test]
fn plain_allreduce_validates_but_does_not_build() {
    let spec = TopologySpec::default();
    assert_eq!(spec.arch, Arch::Allreduce);
    assert!(!spec.has_ps_keys());
    assert!(spec.validate().is_ok());
    assert!(matches!(
        Topology::build(&spec),
        Err(ClusterError::NotParameterServer)
    ));
}

#[test]
fn unknown_and_mistyped_keys_are_rejected_by_the_parser() {
    let msg = build_error("arch: flat\nparameter_server: {aggr_type: sync, num_worker: 2}\n");
    assert!(msg.contains("unknown field `num_worker`"), "{msg}");
    let msg = build_error("arch: star\n");
    assert!(msg.contains("unknown variant `star`"), "{msg}");
    let msg = build_error("arch: flat\nparameter_server: {aggr_type: lazy, num_workers: 2}\n");
    assert!(msg.contains("unknown variant `lazy`"), "{msg}");
    let msg = build_error("arch: flat\nparameter_server: {aggr_type: sync, num_workers: -1}\n");
    assert!(
        msg.starts_with("test.yaml: invalid topology config"),
        "{msg}"
    );
    let msg = build_error("topology: flat\n");
    assert!(msg.contains("unknown field `topology`"), "{msg}");
}

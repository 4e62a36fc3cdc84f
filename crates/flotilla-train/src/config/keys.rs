//! Every config key, declared once ([`KEYS`]): its place in a section (`section.field`), its
//! flat aliases, and its command-line flag with the flag's help and value type. Everything
//! else is derived from this one table:
//! - the flat keys a file or a tree may use ([`by_alias`]; `lr:` is `optimizer.lr`);
//! - the environment's names: `FLOTILLA_<SECTION>__<FIELD>` ([`Key::env_name`]) for every key,
//!   `FLOTILLA_<ALIAS>` for every alias ([`super::sources::Sources::env`]);
//! - the flags of `flotilla train | launch | config | compare` ([`flags`]: the binary builds
//!   its clap arguments from them, and [`super::sources::Sources::flag`] sets their keys).
//!
//! The sections' structs ([`super::TrainConfig`]) give each key its type and default; a test
//! checks that every field of them is declared here exactly once. Why a table of our own:
//! figment merges sources and remembers them but knows no aliases or flags, and clap's derive
//! would declare the flags again in a struct of their own. This is plain `const` data that
//! both sides read, with no macro to learn.

/// How a flag's value is written on the command line; the command line checks it as it reads
/// it (`--epochs many` is refused there, naming the flag).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// No value: the flag sets the key to `true`.
    Switch,
    /// No value: the flag sets the key to `false` (`--no-tls` for `auto_tls`).
    SwitchOff,
    /// Text (the config checks it: a model name, a backend, an address).
    Text,
    /// A file or directory.
    Path,
    /// An unsigned 16-bit number (a port).
    U16,
    /// An unsigned 32-bit number.
    U32,
    /// An unsigned 64-bit number.
    U64,
    /// An unsigned number of the machine's size (a count).
    Usize,
    /// A floating-point number.
    F64,
}

/// A key's command-line flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flag {
    /// The long name: `--<long>`.
    pub long: &'static str,
    /// The short name, if any: `-<short>`.
    pub short: Option<char>,
    /// The value's name in `--help` (`--epochs <EPOCHS>`); none for a switch.
    pub value_name: &'static str,
    /// How the value is written.
    pub kind: Kind,
    /// What the flag does, one line of `--help`.
    pub help: &'static str,
}

/// One config key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Key {
    /// Its place: `section.field`.
    pub path: &'static str,
    /// Its flat names: top-level keys of a file (`lr: 0.1`) and `FLOTILLA_<ALIAS>`.
    pub aliases: &'static [&'static str],
    /// Its flag, if the command line sets it.
    pub flag: Option<Flag>,
}

impl Key {
    /// The key at `section.field`, with no alias and no flag.
    pub const fn new(path: &'static str) -> Key {
        Key {
            path,
            aliases: &[],
            flag: None,
        }
    }

    /// The same key with these flat names.
    pub const fn aliases(self, aliases: &'static [&'static str]) -> Key {
        Key { aliases, ..self }
    }

    /// The same key, set by `--<long> <VALUE_NAME>`.
    pub const fn flag(
        self,
        long: &'static str,
        value_name: &'static str,
        kind: Kind,
        help: &'static str,
    ) -> Key {
        let flag = Flag {
            long,
            short: None,
            value_name,
            kind,
            help,
        };
        Key {
            flag: Some(flag),
            ..self
        }
    }

    /// The same key, set to `true` by `--<long>`.
    pub const fn switch(self, long: &'static str, help: &'static str) -> Key {
        self.flag(long, "", Kind::Switch, help)
    }

    /// The same key, set to `false` by `--<long>`.
    pub const fn switch_off(self, long: &'static str, help: &'static str) -> Key {
        self.flag(long, "", Kind::SwitchOff, help)
    }

    /// The same key, its flag also written `-<short>` (a key without a flag does not compile).
    pub const fn short(self, short: char) -> Key {
        match self.flag {
            Some(flag) => Key {
                flag: Some(Flag {
                    short: Some(short),
                    ..flag
                }),
                ..self
            },
            None => panic!("a short flag needs a flag"),
        }
    }

    /// Its section: `model` of `model.seed`.
    pub fn section(&self) -> &'static str {
        self.path.split_once('.').map_or(self.path, |(s, _)| s)
    }

    /// Its field: `seed` of `model.seed`.
    pub fn field(&self) -> &'static str {
        self.path.split_once('.').map_or("", |(_, f)| f)
    }

    /// Its environment variable: `FLOTILLA_MODEL__SEED`.
    pub fn env_name(&self) -> String {
        env_name(self.path)
    }
}

/// The environment's name of the key at `section.field`: `FLOTILLA_<SECTION>__<FIELD>`.
pub fn env_name(path: &str) -> String {
    format!("FLOTILLA_{}", path.replace('.', "__").to_ascii_uppercase())
}

/// The sections whose fields are not all declared: the optimizer's depend on its `name` (SGD
/// has `momentum`, Adam `beta1`, ...); serde checks them, and [`KEYS`] declares those with
/// an alias or a flag.
pub const OPEN_SECTIONS: &[&str] = &["optimizer"];

/// Every key, section by section (the order of `--help`).
pub const KEYS: &[Key] = &[
    Key::new("model.spec").aliases(&["model"]).flag(
        "model",
        "MODEL",
        Kind::Text,
        "Model: a built-in name (lenet5, mlp) or a spec file",
    ),
    Key::new("model.seed").aliases(&["seed"]).flag(
        "seed",
        "SEED",
        Kind::U64,
        "Seed of initialisation and shuffling",
    ),
    Key::new("model.device").aliases(&["device"]).flag(
        "device",
        "DEVICE",
        Kind::Text,
        "Backend: flex, auto[:N] (a Vulkan GPU if built with wgpu and present, else flex); \
         ndarray, libtorch, cuda[:I] and wgpu[:I] with the cargo features of those names \
         (a GPU named without its index runs each local rank on its own GPU, I on GPU I)",
    ),
    Key::new("model.recompute").aliases(&["recompute"]).switch(
        "recompute",
        "Recompute each block's forward in backward: one block's activations held at a time, \
         the same gradients and running statistics (ZeRO-3 always does)",
    ),
    Key::new("data.path").aliases(&["data"]).flag(
        "data",
        "DATA",
        Kind::Path,
        "Directory with the four MNIST-layout IDX files, or `text:FILE` (byte tokens)",
    ),
    Key::new("data.batch_size").aliases(&["batch_size"]).flag(
        "batch-size",
        "BATCH_SIZE",
        Kind::Usize,
        "Samples per step on each rank",
    ),
    Key::new("data.train_limit").aliases(&["train_limit"]).flag(
        "train-limit",
        "TRAIN_LIMIT",
        Kind::Usize,
        "Use only the first N training samples",
    ),
    Key::new("data.test_limit").aliases(&["test_limit"]).flag(
        "test-limit",
        "TEST_LIMIT",
        Kind::Usize,
        "Evaluate on only the first N test samples",
    ),
    Key::new("optimizer.lr")
        .aliases(&["lr"])
        .flag("lr", "LR", Kind::F64, "Learning rate"),
    Key::new("schedule.epochs")
        .aliases(&["epochs"])
        .flag("epochs", "EPOCHS", Kind::U32, "Epochs"),
    Key::new("schedule.max_steps").aliases(&["max_steps"]).flag(
        "max-steps",
        "MAX_STEPS",
        Kind::U64,
        "Stop after this many steps",
    ),
    Key::new("schedule.lr_schedule").aliases(&["lr_schedule"]),
    Key::new("schedule.warmup_steps").aliases(&["warmup_steps"]),
    Key::new("schedule.min_lr_ratio").aliases(&["min_lr_ratio"]),
    Key::new("schedule.eval_every").aliases(&["eval_every"]),
    Key::new("schedule.eval_every_steps").aliases(&["eval_every_steps"]),
    Key::new("schedule.checkpoint_every")
        .aliases(&["checkpoint_every"])
        .flag(
            "checkpoint-every",
            "CHECKPOINT_EVERY",
            Kind::U64,
            "Checkpoint every K steps (0: only at the end)",
        ),
    Key::new("schedule.resume").aliases(&["resume"]).switch(
        "resume",
        "Resume from the newest checkpoint in the output directory",
    ),
    Key::new("schedule.num_server_rounds").aliases(&["num_server_rounds"]),
    Key::new("schedule.target_accuracy").aliases(&["target_accuracy"]),
    Key::new("schedule.target_loss").aliases(&["target_loss"]),
    Key::new("schedule.divergence_check_rounds").aliases(&["divergence_check_rounds"]),
    Key::new("schedule.abort_on_divergence").aliases(&["abort_on_divergence"]),
    Key::new("topology.world_size")
        .aliases(&["world_size"])
        .flag("world-size", "WORLD_SIZE", Kind::Usize, "Number of ranks")
        .short('n'),
    Key::new("topology.min_world_size")
        .aliases(&["min_world_size"])
        .flag(
            "min-world-size",
            "MIN",
            Kind::Usize,
            "Elastic: the fewest ranks the job trains with (`-n MIN:MAX` says both)",
        ),
    // `strategy` (and `arch`) also take `sync_allreduce` / `async_allreduce`, which set
    // `allreduce.mode` too (`super::sources`).
    Key::new("topology.arch")
        .aliases(&["arch", "strategy"])
        .flag(
            "strategy",
            "STRATEGY",
            Kind::Text,
            "sync_allreduce, async_allreduce, flat, hierarchical (parameter servers) or pipeline",
        ),
    Key::new("topology.parameter_server").aliases(&["parameter_server"]),
    Key::new("topology.global_server").aliases(&["global_server"]),
    Key::new("topology.servers").aliases(&["servers"]),
    Key::new("topology.max_staleness").aliases(&["max_staleness"]),
    Key::new("topology.staleness_lr").aliases(&["staleness_lr"]),
    Key::new("topology.async_momentum").aliases(&["async_momentum"]),
    Key::new("topology.local_steps").aliases(&["local_steps"]),
    Key::new("topology.inventory").aliases(&["inventory"]).flag(
        "inventory",
        "INVENTORY",
        Kind::Path,
        "Inventory (hcddl `[pool]` ini or a host list): the topology must fit on its hosts",
    ),
    Key::new("pipeline.stages").aliases(&["stages"]).flag(
        "stages",
        "S",
        Kind::Usize,
        "Pipeline stages (strategy pipeline)",
    ),
    Key::new("pipeline.split_points").aliases(&["split_points"]),
    Key::new("pipeline.micro_batches")
        .aliases(&["micro_batches"])
        .flag(
            "micro-batches",
            "M",
            Kind::Usize,
            "Micro-batches per batch (strategy pipeline)",
        ),
    // A string, not the `schedule` section: `schedule: 1f1b`.
    Key::new("pipeline.schedule").aliases(&["schedule"]),
    Key::new("pipeline.data_parallel")
        .aliases(&["data_parallel"])
        .flag(
            "data-parallel",
            "D",
            Kind::Usize,
            "Replicas of every pipeline stage (strategy pipeline)",
        ),
    Key::new("pipeline.hosts"),
    Key::new("allreduce.mode"),
    Key::new("allreduce.overlap").aliases(&["overlap"]),
    Key::new("allreduce.sync_batch_norm").aliases(&["sync_batch_norm"]),
    Key::new("allreduce.zero").aliases(&["zero"]).flag(
        "zero",
        "STAGE",
        Kind::Usize,
        "ZeRO: 1 shards the optimizer state, 2 also the gradients, 3 also the parameters (sync all-reduce; 1 to 3 among a pipeline's replicas too)",
    ),
    Key::new("allreduce.prefetch").aliases(&["prefetch"]),
    Key::new("allreduce.reshard_after_forward").aliases(&["reshard_after_forward"]),
    Key::new("allreduce.offload")
        .aliases(&["offload", "offload_optimizer"])
        .flag(
            "offload",
            "DIR",
            Kind::Path,
            "ZeRO: keep each rank's shard of the optimizer state in files under DIR, not in memory (the same bits; a step streams through them)",
        ),
    Key::new("allreduce.accumulation_steps")
        .aliases(&["accumulation_steps", "gradient_accumulation_steps"])
        .flag(
            "accumulation-steps",
            "K",
            Kind::Usize,
            "Micro-batches per step, summed before one all-reduce (sync all-reduce; see --reduce-each-micro-batch)",
        ),
    Key::new("allreduce.reduce_each_micro_batch")
        .aliases(&["reduce_each_micro_batch"])
        .switch(
            "reduce-each-micro-batch",
            "Reduce every micro-batch's gradients, not their sum (ZeRO-3: the gradient stays sharded)",
        ),
    Key::new("allreduce.clip_grad_norm")
        .aliases(&["clip_grad_norm", "max_grad_norm"])
        .flag(
            "clip-grad-norm",
            "NORM",
            Kind::F64,
            "Clip the gradient to this global norm before each step (sync all-reduce)",
        ),
    Key::new("allreduce.cycle_duration_ms").aliases(&["cycle_duration_ms"]),
    Key::new("allreduce.all_reduce_buffer_size").aliases(&["all_reduce_buffer_size"]),
    Key::new("allreduce.staleness").aliases(&["staleness"]),
    Key::new("allreduce.correction").aliases(&["correction"]),
    Key::new("allreduce.stall_warning_s").aliases(&["stall_warning_s"]),
    Key::new("allreduce.stall_shutdown_s").aliases(&["stall_shutdown_s"]),
    Key::new("comm.backend").aliases(&["backend"]).flag(
        "backend",
        "BACKEND",
        Kind::Text,
        "Process-group backend: `tcp` (default), `mpi` (under mpirun; a binary built with \
         `--features mpi`) or `nccl` (f32 collectives over NCCL on each rank's GPU; \
         `--features nccl`)",
    ),
    Key::new("comm.master_addr").aliases(&["master_addr"]).flag(
        "master-addr",
        "MASTER_ADDR",
        Kind::Text,
        "Rendezvous address of rank 0",
    ),
    Key::new("comm.master_port").aliases(&["master_port"]).flag(
        "master-port",
        "MASTER_PORT",
        Kind::U16,
        "Rendezvous port of rank 0",
    ),
    Key::new("comm.timeout_s").aliases(&["timeout_s"]).flag(
        "timeout-s",
        "TIMEOUT_S",
        Kind::F64,
        "Deadline in seconds of every wait on another rank",
    ),
    Key::new("comm.join_timeout_s").aliases(&["join_timeout_s"]),
    Key::new("comm.compression").aliases(&["compression"]),
    Key::new("comm.wire_format").aliases(&["wire_format"]),
    Key::new("comm.bucket_mb").aliases(&["bucket_mb"]).flag(
        "bucket-mb",
        "BUCKET_MB",
        Kind::F64,
        "Gradient fusion bucket size in MiB",
    ),
    Key::new("comm.small_all_reduce_kb").aliases(&["small_all_reduce_kb"]),
    Key::new("comm.mid_all_reduce_kb").aliases(&["mid_all_reduce_kb"]),
    Key::new("comm.transport").aliases(&["transport"]),
    Key::new("comm.hierarchical").aliases(&["hierarchical"]),
    Key::new("comm.chunk_kb").aliases(&["chunk_kb"]),
    Key::new("comm.shm_chunk_kb").aliases(&["shm_chunk_kb"]),
    Key::new("comm.max_queued_mb").aliases(&["max_queued_mb"]),
    Key::new("comm.socket_buffer_kb").aliases(&["socket_buffer_kb"]),
    Key::new("comm.threads"),
    Key::new("comm.shm_dir").aliases(&["shm_dir"]),
    // The secret is never a key: only its file is (and the environment's variables win).
    Key::new("comm.secret_file"),
    Key::new("comm.insecure").aliases(&["insecure"]).switch(
        "insecure",
        "Run without a cluster secret or TLS: any process that reaches the job's ports can \
         join it (a trusted network only; `flotilla launch` otherwise makes a secret per job)",
    ),
    Key::new("comm.tls"),
    Key::new("comm.auto_tls").aliases(&["auto_tls"]).switch_off(
        "no-tls",
        "With --inventory: no TLS of the launcher's own between the hosts (plain TCP, \
         authenticated by the secret only: a trusted network)",
    ),
    Key::new("telemetry.output").aliases(&["output"]).flag(
        "output",
        "OUTPUT",
        Kind::Path,
        "Output directory (checkpoints, metrics, each rank's run.log)",
    ),
    Key::new("telemetry.timeline_path")
        .aliases(&["timeline_path"])
        .flag(
            "timeline",
            "FILE",
            Kind::Path,
            "Write a Chrome trace (Perfetto, chrome://tracing) of the whole job to this file",
        ),
    Key::new("telemetry.metrics_port")
        .aliases(&["metrics_port"])
        .flag(
            "metrics-port",
            "P",
            Kind::U16,
            "Serve Prometheus metrics: rank r on port P + r at /metrics",
        ),
    Key::new("telemetry.metrics_addr")
        .aliases(&["metrics_addr"])
        .flag(
            "metrics-addr",
            "ADDR",
            Kind::Text,
            "Interface /metrics listens on (default 127.0.0.1; 0.0.0.0 opens it to the network)",
        ),
];

/// The key a flat name stands for (`lr` → `optimizer.lr`).
pub fn by_alias(alias: &str) -> Option<&'static Key> {
    KEYS.iter().find(|k| k.aliases.contains(&alias))
}

/// The key `--<long>` sets.
pub fn by_flag(long: &str) -> Option<&'static Key> {
    KEYS.iter().find(|k| k.flag.is_some_and(|f| f.long == long))
}

/// Every flag with its key, in the table's order.
pub fn flags() -> impl Iterator<Item = (&'static Key, Flag)> {
    KEYS.iter().filter_map(|k| k.flag.map(|f| (k, f)))
}

/// Whether `section` is a section of the config (one with a key in [`KEYS`]); any other
/// top-level key is an alias or an error.
pub fn is_section(section: &str) -> bool {
    KEYS.iter().any(|k| k.section() == section)
}

/// Whether `section.field` names a key: a declared one, or any field of an open section.
pub fn is_key(section: &str, field: &str) -> bool {
    OPEN_SECTIONS.contains(&section)
        || KEYS
            .iter()
            .any(|k| k.section() == section && k.field() == field)
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use serde_json::Value;

    use super::*;
    use crate::config::TrainConfig;

    /// A config's tree as serde writes it: `{section: {field: value}}`.
    fn tree(yaml: &str) -> Value {
        let config = TrainConfig::from_yaml(yaml, "t.yaml").expect(yaml);
        serde_json::to_value(config).expect("json")
    }

    #[test]
    fn every_field_of_the_config_is_declared_exactly_once() {
        let defaults = tree("");
        let sections = defaults.as_object().expect("sections");
        // The table's sections are the config's, each in one run of keys.
        let mut declared: Vec<&str> = KEYS.iter().map(Key::section).collect();
        declared.dedup();
        let mut names: Vec<&str> = sections.keys().map(String::as_str).collect();
        declared.sort_unstable();
        names.sort_unstable();
        assert_eq!(declared, names);
        for (section, fields) in sections {
            if OPEN_SECTIONS.contains(&section.as_str()) {
                continue;
            }
            for field in fields.as_object().expect("a section is a mapping").keys() {
                let n = KEYS
                    .iter()
                    .filter(|k| k.section() == section && k.field() == field)
                    .count();
                assert_eq!(n, 1, "`{section}.{field}` is declared {n} times");
            }
        }
        // Every declared key is a field; an open section's, of each of its kinds.
        let optimizers = ["sgd", "adam", "adamw"]
            .map(|name| tree(&format!("optimizer: {{name: {name}, lr: 0.1}}\n")));
        let mut paths = HashSet::new();
        for k in KEYS {
            assert!(paths.insert(k.path), "`{}` is declared twice", k.path);
            let trees = if OPEN_SECTIONS.contains(&k.section()) {
                &optimizers[..]
            } else {
                std::slice::from_ref(&defaults)
            };
            for t in trees {
                assert!(
                    t[k.section()].get(k.field()).is_some(),
                    "`{}` is no field of {t}",
                    k.path
                );
            }
        }
    }

    #[test]
    fn aliases_flags_and_environment_names_are_unique() {
        let (mut aliases, mut longs, mut shorts) = (HashSet::new(), HashSet::new(), HashSet::new());
        // The FLOTILLA_ variables of other parts (the secret, TLS, tests, the launcher).
        let mut env: HashSet<String> = [
            "FLOTILLA_SECRET",
            "FLOTILLA_SECRET_FILE",
            "FLOTILLA_TOKEN",
            "FLOTILLA_TLS_CA",
            "FLOTILLA_TLS_CERT",
            "FLOTILLA_TLS_KEY",
            "FLOTILLA_FAULT",
            "FLOTILLA_REJOIN",
            "FLOTILLA_PROGRESS",
        ]
        .map(String::from)
        .into();
        for k in KEYS {
            assert!(env.insert(k.env_name()), "{}", k.env_name());
            for a in k.aliases {
                assert!(aliases.insert(*a), "alias `{a}` of two keys");
                let name = format!("FLOTILLA_{}", a.to_ascii_uppercase());
                assert!(env.insert(name.clone()), "{name}");
                assert_eq!(by_alias(a), Some(k));
            }
            if let Some(f) = k.flag {
                assert!(longs.insert(f.long), "--{} of two keys", f.long);
                assert!(f.short.is_none_or(|s| shorts.insert(s)), "{f:?}");
                assert_eq!(by_flag(f.long), Some(k));
                assert!(!f.help.is_empty() && !f.help.ends_with('.'), "{f:?}");
                let switch = matches!(f.kind, Kind::Switch | Kind::SwitchOff);
                let named = switch || !f.value_name.is_empty();
                assert!(named, "--{} has no value name", f.long);
            }
        }
        assert_eq!(KEYS[0].env_name(), "FLOTILLA_MODEL__SPEC");
        assert!(is_key("optimizer", "beta1") && !is_key("data", "batchsize"));
    }
}

//! Command-line arguments. The flags of a run are not listed here: [`RunArgs`] takes them
//! from the config's key table.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::run_args::RunArgs;

/// Distributed deep-learning training for Rust.
#[derive(Debug, Parser)]
#[command(name = "flotilla", version, about, propagate_version = true)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run one rank of a training job. The rank, world size and rendezvous address come from
    /// flags or, as torchrun / mpirun / Slurm set them, from RANK, WORLD_SIZE, MASTER_ADDR and
    /// MASTER_PORT.
    Train(TrainArgs),
    /// Start the ranks of a training job and supervise them: N local processes, or with
    /// `--inventory` one per inventory host over ssh. If one fails, all are stopped and its
    /// error is shown; Ctrl-C stops them all. After `--`, any program (e.g. your own burn
    /// training program using flotilla-burn) is started as the ranks instead of `flotilla train`.
    Launch(LaunchArgs),
    /// End the ranks that `flotilla launch --inventory` started on the inventory's hosts, by
    /// the pids they recorded in their job directories.
    Stop(StopArgs),
    /// Run one config in several strategies, one after the other on this machine (each as
    /// `flotilla launch` would, into `OUTPUT/<strategy>/`), and write `OUTPUT/compare.md` and
    /// `OUTPUT/compare.svg`: time to the target accuracy, final accuracy, samples/s, bytes moved
    /// per sample.
    ///
    /// `--output` is the report's directory (default: the config's output); `-n` is the number
    /// of ranks computing gradients in every strategy (default: the config's all-reduce peers,
    /// parameter-server workers or pipeline stages).
    Compare(CompareArgs),
    /// Benchmarks that print ratios against a reference measured in the same run.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Print the effective configuration (defaults, file and flags merged) as YAML, and the
    /// topology with its placement on the inventory's hosts.
    Config(RunArgs),
    /// Timelines: merge the ranks' files of a job started without `flotilla launch`.
    #[command(subcommand)]
    Trace(TraceCommand),
    /// Make a cluster CA and a certificate per host for mutual TLS on every connection of a
    /// job (`comm.tls`): `DIR/ca.pem`, `DIR/ca.key`, `DIR/<host>.pem`, `DIR/<host>.key`.
    /// An existing CA in DIR signs the new hosts.
    Certs(crate::certs::CertsArgs),
    /// Make a fresh random cluster secret: printed, or with `--out FILE` written to a new
    /// file of mode 0600 for every rank (`FLOTILLA_SECRET_FILE=FILE`). `flotilla launch`
    /// makes one for each job itself; this is for ranks started another way.
    Secret(crate::secret::SecretArgs),
    /// Show what a checkpoint holds (step and place in the data, model, ZeRO shards or
    /// pipeline stages, optimizer state, tensors, files); with `--export FILE`, write the
    /// whole of it as one safetensors file PyTorch loads.
    Checkpoint(crate::checkpoint::CheckpointArgs),
}

/// `flotilla trace ...`.
#[derive(Debug, Subcommand)]
pub enum TraceCommand {
    /// Merge rank timelines (`<output>/rank-N/timeline.jsonl`) into one Chrome trace file.
    Merge(TraceMergeArgs),
}

/// `flotilla trace merge`.
#[derive(Debug, Clone, Args)]
pub struct TraceMergeArgs {
    /// The merged Chrome trace to write.
    #[arg(short, long)]
    pub output: PathBuf,
    /// The ranks' timeline files.
    #[arg(required = true)]
    pub inputs: Vec<PathBuf>,
}

/// `flotilla train`.
#[derive(Debug, Clone, Args)]
pub struct TrainArgs {
    /// The config and its overrides.
    #[command(flatten)]
    pub run: RunArgs,
    /// This process's rank (default: $RANK, else assigned by rank 0).
    #[arg(long)]
    pub rank: Option<usize>,
}

/// `flotilla launch`.
#[derive(Debug, Clone, Args)]
pub struct LaunchArgs {
    /// The config and its overrides.
    #[command(flatten)]
    pub run: RunArgs,
    /// Threads per rank (sets RAYON_NUM_THREADS, OMP_NUM_THREADS and MKL_NUM_THREADS in each
    /// rank unless already set).
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Start more local ranks than this machine's limits allow (8 per core, and the ranks'
    /// estimated memory within what is available).
    #[arg(long)]
    pub oversubscribe: bool,
    /// Confine each local rank to this much memory (`512M`, `2G`, `1.5GiB`): a memory cgroup
    /// per rank (cgroup v1's `memory.limit_in_bytes`). The launch is refused before any rank
    /// starts when a rank's estimated peak is above it, and a rank the kernel's OOM killer
    /// takes at the limit is named as such.
    #[arg(long, value_name = "SIZE")]
    pub memory_per_rank: Option<bytesize::ByteSize>,
    /// Binding of local ranks to cores: `auto` binds rank `r` of `t` threads to cores
    /// `r t .. r t + t` (modulo the cores) when the local ranks' threads outnumber the cores
    /// and every rank computes (all-reduce or pipeline; not parameter servers, nor a
    /// program's ranks after `--`), `core` always, `none` never (the rank sees its list in
    /// FLOTILLA_CPUS).
    #[arg(long, value_enum, default_value_t)]
    pub bind: crate::binding::Bind,
    /// When a rank fails, start the whole job again from the newest checkpoint (see
    /// `checkpoint_every`), up to this many times; each restart is logged with its cause. A
    /// worker whose parameter servers are all asynchronous is restarted alone instead and
    /// rejoins the running job (it counts as a restart). In an elastic job (`-n MIN:MAX`) a
    /// failed rank is replaced alone, by a new process that joins the running job.
    #[arg(long, default_value_t = 0)]
    pub max_restarts: u32,
    /// An elastic job (`-n MIN:MAX`): how many processes to start here (default MAX; at
    /// least MIN); more may join the running job later, up to MAX (the command to start one
    /// is printed).
    #[arg(long, value_name = "N")]
    pub start_ranks: Option<usize>,
    /// Where ranks go with `--inventory`.
    #[command(flatten)]
    pub remote: RemoteArgs,
    /// A program to start as the ranks instead of `flotilla train`, after `--`, with its
    /// arguments (`flotilla launch -n 2 -- target/release/examples/custom_model`). Each rank
    /// gets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (as torchrun sets them),
    /// every other setting given (file, environment, flags) as `FLOTILLA_<SECTION>__<FIELD>`,
    /// and the job's secret and TLS files; the ranks are
    /// supervised as training ranks are (the first failure stops them all and is named;
    /// `--max-restarts` starts the program again). With `--inventory`, the program must be
    /// at the same path on every host.
    #[arg(last = true, value_name = "PROGRAM")]
    pub program: Vec<std::ffi::OsString>,
}

/// `flotilla launch --inventory`: how the ranks reach their hosts.
#[derive(Debug, Clone, Args)]
pub struct RemoteArgs {
    /// With `--inventory`: copy this binary, the config and the model spec file into the
    /// job's directory on every host first (the data path stays the user's).
    #[arg(long)]
    pub sync: bool,
    /// With `--inventory`: parent of the per-job directories on the hosts (relative paths are
    /// under the ssh login directory).
    #[arg(long, default_value = crate::launch::remote::DEFAULT_REMOTE_DIR)]
    pub remote_dir: String,
    /// With `--inventory` and without `--sync`: the binary's path on the hosts (default: this
    /// binary's own path).
    #[arg(long)]
    pub remote_exe: Option<String>,
}

impl Default for RemoteArgs {
    fn default() -> Self {
        RemoteArgs {
            sync: false,
            remote_dir: crate::launch::remote::DEFAULT_REMOTE_DIR.to_owned(),
            remote_exe: None,
        }
    }
}

/// `flotilla stop`.
#[derive(Debug, Clone, Args)]
pub struct StopArgs {
    /// The inventory the job was launched on.
    #[arg(long)]
    pub inventory: PathBuf,
    /// Only this job (its id, printed by `launch` and written to `<output>/job.json`);
    /// default: every job under `--remote-dir`.
    #[arg(long)]
    pub job: Option<String>,
    /// Parent of the per-job directories, as given to `launch`.
    #[arg(long, default_value = crate::launch::remote::DEFAULT_REMOTE_DIR)]
    pub remote_dir: String,
}

/// `flotilla compare`.
#[derive(Debug, Clone, Args)]
pub struct CompareArgs {
    /// The config and its overrides (`--output` and `-n` as the command's help says).
    #[command(flatten)]
    pub run: RunArgs,
    /// Strategies to run, in order: sync_allreduce, ps_flat_sync, ps_flat_async,
    /// ps_hierarchical, pipeline, async_allreduce.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = flotilla_train::presets::DEFAULT_PRESETS
    )]
    pub strategies: Vec<String>,
    /// The accuracy whose time to reach is compared (default: the config's
    /// `target_accuracy`, else 0.98). A text job compares the time to its `target_loss`
    /// (else 1.6 nats) instead.
    #[arg(long)]
    pub target_accuracy: Option<f64>,
    /// Threads per rank (as `flotilla launch --threads`).
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// A program to run as each strategy's ranks instead of `flotilla train`, after `--`
    /// (one on `flotilla_burn::train`: `flotilla compare -- target/release/examples/lenet5_program`),
    /// given each strategy's settings as `flotilla launch -- PROGRAM` gives them.
    #[arg(last = true, value_name = "PROGRAM")]
    pub program: Vec<std::ffi::OsString>,
}

/// `flotilla bench ...`.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Ring all-reduce bandwidth over loopback with N local ranks.
    Allreduce(BenchAllreduceArgs),
    /// Samples per second of one training step (forward, backward, optimizer).
    Step(BenchStepArgs),
    /// Parameter-server topologies: updates/s and bytes received at the root (flat vs
    /// hierarchical vs sharded), or time to a target accuracy for every combination.
    Ps(BenchPsArgs),
    /// Pipeline schedules: throughput, measured bubble against the ideal, activations in
    /// flight and the automatic cut's balance, for several stage and micro-batch counts.
    Pipeline(BenchPipelineArgs),
    /// The GEMM rate of this machine (square f32 products, the kernel every linear layer
    /// runs): what a model's FLOP rate is a fraction of.
    Gemm(BenchGemmArgs),
    /// Internal: one rank of `bench allreduce`.
    #[command(hide = true)]
    AllreduceWorker(BenchAllreduceArgs),
}

/// `flotilla bench allreduce`.
#[derive(Debug, Clone, Args)]
pub struct BenchAllreduceArgs {
    /// Numbers of ranks to measure, e.g. `2,4`.
    #[arg(short = 'n', long, value_delimiter = ',', default_value = "2,4")]
    pub ranks: Vec<usize>,
    /// Buffer sizes in bytes (suffixes K, M allowed), e.g. `4K,1M,64M`; default 4 KiB to 256 MiB.
    #[arg(long, value_delimiter = ',')]
    pub sizes: Vec<String>,
    /// Timed iterations per size (capped for large sizes).
    #[arg(long, default_value_t = 20)]
    pub iters: usize,
    /// Use bf16 on the wire.
    #[arg(long)]
    pub bf16: bool,
    /// `tcp`: Flotilla's ring; `mpi`: the MPI backend under mpirun, next to the TCP ring and
    /// to Open MPI's own MPI_Allreduce (a binary built with `--features mpi`).
    #[arg(long, default_value = "tcp", value_parser = ["tcp", "mpi"])]
    pub backend: String,
    /// Transports of the TCP backend to measure, each in its own job, e.g. `tcp,shm`:
    /// `auto` (shared memory between ranks of this host; the default unless
    /// FLOTILLA_COMM__TRANSPORT says otherwise), `tcp` (the ring and recursive doubling over
    /// 127.0.0.1) or `shm`.
    #[arg(long, value_delimiter = ',', value_parser = ["auto", "tcp", "shm"])]
    pub transport: Vec<String>,
    /// Binding of the ranks to cores, as `flotilla launch --bind`.
    #[arg(long, value_enum, default_value_t)]
    pub bind: crate::binding::Bind,
}

/// `flotilla bench step`.
#[derive(Debug, Clone, Args)]
pub struct BenchStepArgs {
    /// Models, e.g. `mlp,lenet5`.
    #[arg(long, value_delimiter = ',', default_value = "mlp,lenet5")]
    pub models: Vec<String>,
    /// Batch sizes.
    #[arg(long, value_delimiter = ',', default_value = "64,256")]
    pub batches: Vec<usize>,
    /// Thread counts.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    pub threads: Vec<usize>,
    /// Timed steps per case (after 5 warm-up steps).
    #[arg(long, default_value_t = 30)]
    pub steps: usize,
    /// Runs of each side per case, alternating (ours, theirs, ours, ...); each side keeps
    /// its best run, as noise on a shared machine only ever slows a run down.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    pub rounds: u32,
    /// The burn backend Flotilla's side runs on (`flex`, `auto`, or one this build adds:
    /// `ndarray`, `libtorch`, `wgpu`), as `model.device` names it.
    #[arg(long, default_value = "flex")]
    pub device: String,
    /// The Python that runs the PyTorch reference (one with torch installed); default:
    /// scripts/torch_python.py's (`$FLOTILLA_TORCH_PYTHON`, else the venv of
    /// scripts/torch_venv.sh with the newest torch, else `python3`).
    #[arg(long)]
    pub python: Option<String>,
}

/// `flotilla bench gemm`.
#[derive(Debug, Clone, Args)]
pub struct BenchGemmArgs {
    /// Sizes of the square matrices, e.g. `1024,2048`.
    #[arg(long, value_delimiter = ',', default_value = "1024,2048")]
    pub sizes: Vec<usize>,
    /// Thread counts (default: 1 and every core this process may use).
    #[arg(long, value_delimiter = ',')]
    pub threads: Vec<usize>,
    /// Timed products per case (after one untimed); each case keeps its best.
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
}

/// `flotilla bench pipeline`.
#[derive(Debug, Clone, Args)]
pub struct BenchPipelineArgs {
    /// Stage counts to measure, e.g. `2,3,4`.
    #[arg(short = 's', long, value_delimiter = ',', default_value = "2,3,4")]
    pub stages: Vec<usize>,
    /// Micro-batch counts, e.g. `1,2,4,8`.
    #[arg(short = 'm', long, value_delimiter = ',', default_value = "1,2,4,8")]
    pub micro_batches: Vec<usize>,
    /// Training steps per case.
    #[arg(long, default_value_t = 40)]
    pub steps: usize,
    /// Samples per batch.
    #[arg(long, default_value_t = 64)]
    pub batch_size: usize,
    /// Model.
    #[arg(long, default_value = "resnet-mnist")]
    pub model: String,
    /// Passes over every case (each case is reported by its median pass, with the spread).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
}

/// `flotilla bench ps`.
#[derive(Debug, Clone, Args)]
pub struct BenchPsArgs {
    /// Worker counts to measure, e.g. `2,4,8`.
    #[arg(short = 'n', long, value_delimiter = ',', default_value = "2,4,8")]
    pub workers: Vec<usize>,
    /// Server rounds per throughput run.
    #[arg(long, default_value_t = 200)]
    pub rounds: u64,
    /// Samples per worker push.
    #[arg(long, default_value_t = 32)]
    pub batch_size: usize,
    /// Model.
    #[arg(long, default_value = "lenet5")]
    pub model: String,
    /// Instead of throughput: run every topology combination (flat sync/async, hierarchical
    /// sync/sync, sync/async, async/async, sharded, model averaging) with 4 workers until
    /// this test accuracy, and report the time.
    #[arg(long)]
    pub time_to_accuracy: Option<f64>,
}

/// `-n MIN:MAX` (also `--world-size MIN:MAX`, `-nMIN:MAX`, `--world-size=MIN:MAX`): an
/// elastic job's sizes, as `--world-size MAX --min-world-size MIN` (the two settings the
/// config has). Every other argument, and everything after `--` (a program's own), as given.
pub fn expand_size_range(
    args: impl IntoIterator<Item = std::ffi::OsString>,
) -> Vec<std::ffi::OsString> {
    let mut out = Vec::new();
    let mut args = args.into_iter();
    let mut size_next = false;
    while let Some(arg) = args.next() {
        let text = arg.to_string_lossy().into_owned();
        if text == "--" {
            out.push(arg);
            out.extend(args.by_ref());
            break;
        }
        let value = if size_next {
            size_next = false;
            Some(text.as_str())
        } else if text == "-n" || text == "--world-size" {
            size_next = true;
            out.push(arg);
            continue;
        } else {
            text.strip_prefix("--world-size=")
                .or_else(|| text.strip_prefix("-n").filter(|v| !v.is_empty()))
        };
        match value.and_then(|v| v.split_once(':')) {
            Some((min, max)) => {
                if !out.last().is_some_and(|a| a == "-n" || a == "--world-size") {
                    out.push("--world-size".into());
                }
                out.push(max.into());
                out.push("--min-world-size".into());
                out.push(min.into());
            }
            None => out.push(arg),
        }
    }
    out
}

#[cfg(test)]
mod size_range_tests {
    use super::expand_size_range;

    fn expand(args: &[&str]) -> Vec<String> {
        expand_size_range(args.iter().map(|a| a.into()))
            .into_iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect()
    }

    #[test]
    fn a_size_range_is_max_and_min() {
        let elastic = [
            "flotilla",
            "launch",
            "--world-size",
            "4",
            "--min-world-size",
            "3",
        ];
        assert_eq!(
            expand(&["flotilla", "launch", "-n", "3:4"]),
            ["flotilla", "launch", "-n", "4", "--min-world-size", "3"]
        );
        assert_eq!(expand(&["flotilla", "launch", "--world-size=3:4"]), elastic);
        assert_eq!(expand(&["flotilla", "launch", "-n3:4"]), elastic);
        let fixed = ["flotilla", "launch", "-n", "4", "--", "prog", "-n", "1:2"];
        assert_eq!(
            expand(&fixed),
            fixed,
            "a program's own arguments are its own"
        );
    }
}

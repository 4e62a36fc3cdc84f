//! What this machine can run: a local job larger than that is refused before any rank starts
//! (`flotilla launch -n 100000` once started thousands of processes and took the launcher
//! down). `--oversubscribe` lifts the limits.
//!
//! - **Cores**: at most [`RANKS_PER_CORE`] ranks per core (`std::thread::available_parallelism`,
//!   which honours CPU affinity and cgroup quotas).
//! - **Memory**: the ranks' estimated footprint must fit in `MemAvailable` (`/proc/meminfo`;
//!   no check where it cannot be read). A rank holds its data set as `f32` (four bytes per
//!   byte of the IDX files) plus [`RANK_BASE_BYTES`] for the runtime, a small model's state
//!   and buffers; a LeNet-5 rank on MNIST measured 240 MB resident against 316 MB estimated.
//!   Under `--memory-per-rank` a config's model state counts too, by ZeRO stage
//!   ([`model_state_bytes`]).

use std::path::Path;

use anyhow::{Result, bail};

/// Most ranks per core a local launch starts without `--oversubscribe`.
pub const RANKS_PER_CORE: usize = 8;

/// A rank's footprint besides its data set.
pub const RANK_BASE_BYTES: u64 = 96 << 20;

/// Bytes one rank is expected to hold, from the size of the files in its data directory.
pub fn rank_footprint(data_dir: &Path) -> u64 {
    // A text data set is one file.
    let file = std::fs::metadata(data_dir).ok().filter(|m| m.is_file());
    let data: u64 = file.map(|m| m.len()).unwrap_or_else(|| {
        std::fs::read_dir(data_dir)
            .map(|entries| {
                entries
                    .filter_map(|e| e.ok()?.metadata().ok())
                    .filter(|m| m.is_file())
                    .map(|m| m.len())
                    .sum()
            })
            .unwrap_or(0)
    });
    RANK_BASE_BYTES + 4 * data
}

/// How a data-parallel rank's model state is spread ([`model_state_bytes`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sharding {
    /// The ZeRO stage.
    pub zero: u8,
    /// The ranks that share it.
    pub ranks: usize,
    /// An elastic job: each optimizer shard is also held by a second rank.
    pub elastic: bool,
    /// The optimizer state in files (`allreduce.offload`).
    pub offload: bool,
    /// ZeRO-3 keeps every group's gathered parameters from its forward to its backward
    /// (`allreduce.reshard_after_forward: false`).
    pub kept: bool,
    /// Bytes of a table a tied head borrows from the first group (`tie_embedding`; 0: none).
    pub tied: u64,
}

/// A data-parallel rank's model state in bytes, by ZeRO stage, for a model of `params`
/// parameters whose optimizer keeps `slots` values per parameter, sharded as `sharding`
/// says (the stage over its ranks; elastic: each optimizer shard is also held by a second
/// rank), buckets of `bucket` bytes; four bytes a value, each term a copy the step holds:
/// - the parameters; burn's gradients after backward, and the engine's flat copy of them;
/// - the averaged gradient kept for the step (stage 1 and 2: this rank's 1/N);
/// - the wire buffers (every bucket's; stage 2: one bucket);
/// - the gathered parameters (stage 1 and 2);
/// - the optimizer state (stage 1 and 2: 1/N; 2/N elastic);
/// - the step's transients: the update and the new parameters before the old are dropped;
///
/// and 15 % over their sum. Measured against the kernel's peak (`VmHWM`) of a 23 M-parameter
/// MLP (SGD with momentum, 2 ranks, `tests/memory_limit.rs`): ZeRO-0 785–874 MiB and ZeRO-2
/// 650–721 MiB resident, against estimates (with the data and the runtime) of 954 and 881 MiB.
///
/// Stage 3 (`layer`: the bytes of the model's largest layer) holds 1/N of the parameters, of
/// the averaged gradient and of the optimizer state; one backward group at a time gathered
/// (its values, burn's tensors of them and their gradients) and two bucket-sized wire
/// buffers (the gradients' reduce-scatter; the parameters' all-gather, which the next group's
/// prefetch takes in turn), five groups' worth (a group the larger of a bucket and the
/// largest layer); and
/// at a checkpoint, its optimizer share serialized and, on rank 0, another rank's received:
/// three shares.
///
/// A head tied to the embedding (stage 3, resharding): the table kept from the first group's
/// gather, lent to the head's group and the head's gradient of it held: three tables more.
///
/// Kept (`allreduce.reshard_after_forward: false`, stage 3): every group's gathered
/// parameters are held from its forward to its backward, a whole copy more at the end of
/// forward.
///
/// Offloaded (`allreduce.offload`, stages 1 to 3): the optimizer state is in files; a step
/// holds one chunk's state at a time, three times (read, stepped, written), and a checkpoint
/// writes it from the files: three chunks' state in place of the shares' terms.
pub fn model_state_bytes(
    params: u64,
    slots: u64,
    sharding: Sharding,
    (bucket, layer): (u64, u64),
) -> u64 {
    let Sharding {
        zero,
        ranks: n,
        elastic,
        offload,
        kept,
        tied,
    } = sharding;
    let whole = params.saturating_mul(4);
    let n = n.max(1) as u64;
    let chunk = (flotilla_engine::OFFLOAD_CHUNK_VALUES as u64).saturating_mul(4 * slots);
    let in_memory = |optimizer: u64, copies: u64| match offload && zero > 0 {
        true => optimizer.min(chunk).saturating_mul(3),
        false => optimizer.saturating_mul(copies),
    };
    if zero == 3 {
        let share = whole.div_ceil(n);
        let optimizer = in_memory(whole.saturating_mul(slots).div_ceil(n), 4);
        let group = bucket.max(layer).min(whole);
        // Resharding, a tied table is kept from the first group's gather, lent to the head's
        // group and its gradient held for the first group's backward (kept: in `whole`).
        let gathered = if kept { whole } else { tied.saturating_mul(3) };
        let sum = [share, share, optimizer, group.saturating_mul(5), gathered]
            .into_iter()
            .fold(0u64, u64::saturating_add);
        return sum.saturating_add(sum / 100 * 15);
    }
    let share = |bytes: u64| match zero {
        0 => bytes,
        // Elastic: each shard also on a second rank (none on one rank).
        _ => bytes
            .div_ceil(n)
            .saturating_mul(if elastic && n > 1 { 2 } else { 1 }),
    };
    let averaged = if zero > 0 { whole.div_ceil(n) } else { whole };
    let wire = if zero >= 2 { bucket.min(whole) } else { whole };
    let gathered = if zero > 0 { whole } else { 0 };
    let optimizer = in_memory(share(whole.saturating_mul(slots)), 1);
    let transients = whole.saturating_mul(2);
    let sum = [
        whole, whole, whole, averaged, wire, gathered, optimizer, transients,
    ]
    .into_iter()
    .fold(0u64, u64::saturating_add);
    sum.saturating_add(sum / 100 * 15)
}

/// The model state of a config's job on each of its `n` ranks ([`model_state_bytes`]; a
/// parameter server or pipeline rank counted as an unsharded data-parallel one) and what
/// it counts, as the launcher says it.
pub fn config_model_state(config: &flotilla_train::TrainConfig, n: usize) -> Result<(u64, String)> {
    let spec = flotilla_engine::ModelSpec::resolve(&config.model.spec)?;
    let params = spec.param_count()?;
    let slots = config.optimizer.state_slots();
    let data_parallel = config.topology.arch == flotilla_cluster::Arch::Allreduce;
    // An elastic job's shares are largest when it is down to its minimum.
    let elastic = config.topology.min_world_size;
    let n = elastic.map_or(n, |min| min.clamp(1, n.max(1)));
    let zero = if data_parallel && n > 1 {
        config.allreduce.zero
    } else {
        0
    };
    let bucket = config.bucket_bytes() as u64;
    let layer = spec.largest_layer_params()?.saturating_mul(4);
    let offload = config.allreduce.offload.is_some();
    let sharding = Sharding {
        zero,
        ranks: n,
        elastic: elastic.is_some(),
        offload,
        kept: !config.allreduce.reshard_after_forward,
        tied: spec.tied_table_values().saturating_mul(4),
    };
    let bytes = model_state_bytes(params, slots, sharding, (bucket, layer));
    let what = format!(
        "{} for the model's state: {params} parameters, {slots} optimizer value(s) each, ZeRO \
         stage {zero} over {n} rank(s){}{}{}",
        mib(bytes),
        if offload && zero > 0 {
            ", its optimizer state in files"
        } else {
            ""
        },
        if sharding.kept && zero == 3 {
            ", every block's parameters gathered from its forward to its backward"
        } else {
            ""
        },
        if elastic.is_some() {
            " (the elastic job's minimum)"
        } else {
            ""
        }
    );
    Ok((bytes, what))
}

/// `MemAvailable` of `/proc/meminfo`, in bytes.
pub fn memory_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Refuses `n` local ranks of `footprint` bytes each on a machine of `cores` cores and
/// `available` bytes of memory, naming the limit and the way past it.
pub fn check(n: usize, cores: usize, footprint: u64, available: Option<u64>) -> Result<()> {
    let max_ranks = RANKS_PER_CORE * cores.max(1);
    if n > max_ranks {
        bail!(
            "{n} local ranks is more than this machine runs: at most {RANKS_PER_CORE} ranks per \
             core ({cores} cores: {max_ranks} ranks). Use fewer ranks (-n), spread them over \
             hosts (--inventory), or pass --oversubscribe to start them anyway"
        );
    }
    if let Some(available) = available {
        let needed = footprint.saturating_mul(n as u64);
        if needed > available {
            bail!(
                "{n} local ranks need about {} of memory ({} each: the data set as f32 and \
                 {} for the rest) but {} is available. Use fewer ranks (-n), spread them over \
                 hosts (--inventory), or pass --oversubscribe to start them anyway",
                mib(needed),
                mib(footprint),
                mib(RANK_BASE_BYTES),
                mib(available)
            );
        }
    }
    Ok(())
}

/// Refuses a launch whose ranks' estimated footprint (`footprint` bytes each: the data and
/// the rest, [`rank_footprint`]; plus `model`, the model's state and what it counts, where
/// the launcher knows the model) is above the memory each may use (`--memory-per-rank`),
/// naming the ranks and the estimate.
pub fn check_limit(
    n: usize,
    footprint: u64,
    model: Option<(u64, String)>,
    limit: bytesize::ByteSize,
) -> Result<()> {
    let (state, what) = model.unwrap_or((0, "the model's state not known here".into()));
    let total = footprint.saturating_add(state);
    if total <= limit.as_u64() {
        return Ok(());
    }
    bail!(
        "every rank (0 to {}) is estimated to need about {} ({} for the data set as f32, \
         {what}, {} for the rest), above --memory-per-rank {}; no rank was started. Give a \
         larger limit, or drop it",
        n.saturating_sub(1),
        mib(total),
        mib(footprint.saturating_sub(RANK_BASE_BYTES)),
        mib(RANK_BASE_BYTES),
        limit.display().iec()
    );
}

/// Checks a local launch of `n` ranks reading `data_dir` against this machine.
pub fn check_local(n: usize, data_dir: &Path) -> Result<()> {
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    check(n, cores, rank_footprint(data_dir), memory_available())
}

fn mib(bytes: u64) -> String {
    format!("{} MiB", bytes >> 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_name_the_numbers() {
        assert!(check(16, 2, 300 << 20, Some(24 << 30)).is_ok());
        let cores = check(100_000, 2, 300 << 20, None).map_err(|e| e.to_string());
        assert!(
            cores
                .as_ref()
                .is_err_and(|e| e.contains("at most 8 ranks per core (2 cores: 16 ranks)")),
            "{cores:?}"
        );
        let memory = check(16, 2, 2 << 30, Some(8 << 30)).map_err(|e| e.to_string());
        assert!(
            memory.as_ref().is_err_and(|e| e
                .contains("16 local ranks need about 32768 MiB of memory (2048 MiB each")
                && e.contains("but 8192 MiB is available")),
            "{memory:?}"
        );
    }

    /// ZeRO stage `zero` over `ranks`, elastic and offloaded as said, nothing kept.
    fn sharding(zero: u8, ranks: usize, elastic: bool, offload: bool) -> Sharding {
        Sharding {
            zero,
            ranks,
            elastic,
            offload,
            kept: false,
            tied: 0,
        }
    }

    #[test]
    fn the_model_state_shrinks_by_zero_stage_and_doubles_its_shards_when_elastic() {
        // 1,000 parameters (4,000 bytes a copy), Adam (2 values each), 4 ranks, 1 KB buckets.
        let at = |zero, elastic| {
            model_state_bytes(1000, 2, sharding(zero, 4, elastic, false), (1000, 600))
        };
        let margin = |sum: u64| sum + sum / 100 * 15;
        // Parameters, burn's gradients and their flat copy, the averaged gradient, the wire,
        // Adam's two moments, the step's two transients.
        assert_eq!(at(0, false), margin(4000 * 5 + 8000 + 8000));
        // Stage 1: a quarter of the averaged gradient and of Adam's state, the gathered
        // parameters; stage 2 also one bucket on the wire.
        assert_eq!(
            at(1, false),
            margin(4000 * 3 + 1000 + 4000 + 4000 + 2000 + 8000)
        );
        assert_eq!(
            at(2, false),
            margin(4000 * 3 + 1000 + 1000 + 4000 + 2000 + 8000)
        );
        assert_eq!(
            at(2, true),
            margin(4000 * 3 + 1000 + 1000 + 4000 + 4000 + 8000)
        );
        // Stage 3: a quarter of the parameters and of the averaged gradient, Adam's quarter
        // and three more at a checkpoint, five groups of a bucket (above the largest layer).
        assert_eq!(at(3, false), margin(1000 + 1000 + 4 * 2000 + 5 * 1000));
        // Kept from forward to backward: every group's parameters, a whole copy, besides.
        let kept = Sharding {
            kept: true,
            ..sharding(3, 4, false, false)
        };
        let kept = model_state_bytes(1000, 2, kept, (1000, 600));
        assert_eq!(kept, margin(1000 + 1000 + 4 * 2000 + 5 * 1000 + 4000));
        // A tied table of 100 values (400 bytes): its values, the head's copy, its gradient.
        let tied = Sharding {
            tied: 400,
            ..sharding(3, 4, false, false)
        };
        let tied = model_state_bytes(1000, 2, tied, (1000, 600));
        assert_eq!(tied, margin(1000 + 1000 + 4 * 2000 + 5 * 1000 + 3 * 400));
        let larger = model_state_bytes(1000, 2, sharding(3, 4, false, false), (1000, 1600));
        assert_eq!(
            larger,
            margin(1000 + 1000 + 4 * 2000 + 5 * 1600),
            "a layer's group"
        );
        // Offloaded: a chunk's state three times at most in place of the shares' terms (here
        // Adam's quarter is below a chunk: three of it).
        let offloaded = model_state_bytes(1000, 2, sharding(3, 4, false, true), (1000, 600));
        assert_eq!(offloaded, margin(1000 + 1000 + 3 * 2000 + 5 * 1000));
        let big = model_state_bytes(
            100_000_000,
            2,
            sharding(3, 2, false, true),
            (1 << 20, 1 << 20),
        );
        let chunk = flotilla_engine::OFFLOAD_CHUNK_VALUES as u64 * 8;
        let share = 200_000_000;
        assert_eq!(big, margin(share + share + 3 * chunk + 5 * (1 << 20)));
        let at_1 =
            |offload| model_state_bytes(1000, 2, sharding(1, 4, false, offload), (1000, 600));
        assert_eq!(
            at_1(false),
            margin(4000 * 3 + 1000 + 4000 + 4000 + 2000 + 8000)
        );
        assert_eq!(
            at_1(true),
            margin(4000 * 3 + 1000 + 4000 + 4000 + 3 * 2000 + 8000)
        );
    }

    #[test]
    fn a_configs_model_state_is_its_specs_and_an_elastic_jobs_is_at_its_minimum()
    -> anyhow::Result<()> {
        let mut config = flotilla_train::TrainConfig::default();
        config.allreduce.zero = 2;
        let params = flotilla_engine::ModelSpec::resolve(&config.model.spec)?.param_count()?;
        let (slots, bucket) = (config.optimizer.state_slots(), config.bucket_bytes() as u64);
        let spec = flotilla_engine::ModelSpec::resolve(&config.model.spec)?;
        let bucket = (bucket, spec.largest_layer_params()? * 4);
        let (bytes, what) = config_model_state(&config, 4)?;
        assert_eq!(
            bytes,
            model_state_bytes(params, slots, sharding(2, 4, false, false), bucket)
        );
        assert!(what.contains("ZeRO stage 2 over 4 rank(s)"), "{what}");
        // Down to 2 of 4 members, each holds half of the state, twice.
        config.topology.min_world_size = Some(2);
        let (bytes, what) = config_model_state(&config, 4)?;
        assert_eq!(
            bytes,
            model_state_bytes(params, slots, sharding(2, 2, true, false), bucket)
        );
        assert!(
            what.contains("over 2 rank(s) (the elastic job's minimum)"),
            "{what}"
        );
        Ok(())
    }

    #[test]
    fn the_footprint_counts_the_data_as_f32() -> std::io::Result<()> {
        let dir = tempfile::tempdir()?;
        std::fs::write(dir.path().join("a"), vec![0u8; 1000])?;
        std::fs::write(dir.path().join("b"), vec![0u8; 24])?;
        assert_eq!(rank_footprint(dir.path()), RANK_BASE_BYTES + 4096);
        assert_eq!(rank_footprint(&dir.path().join("none")), RANK_BASE_BYTES);
        Ok(())
    }
}

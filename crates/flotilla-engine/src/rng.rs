//! The backend's RNG as training uses it: the lock under which it is seeded and drawn from
//! (it may be process-wide), and the seed of each part's dropout masks in a step, which a
//! recomputed forward re-seeds it with to draw the masks the first forward drew (a spec
//! model's dropout layer, a user's module's block).

/// Serialises seeding the backend's RNG and drawing from it (see `Weights::new` and
/// `Weights::with_dropout_rng`): the RNG may be process-wide.
pub(crate) static RNG_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// What `draw` returns, run holding the lock under which the backend's RNG is seeded and
/// drawn from (the lock is not re-entrant: `draw` must not build a seeded model).
pub(crate) fn under_rng_lock<T>(draw: impl FnOnce() -> T) -> T {
    let _guard = RNG_LOCK
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    draw()
}

/// Holds the lock under which the backend's RNG is seeded and drawn from. A test that lets
/// burn initialise a module itself (lazily, at its first use) holds it for its whole run, so
/// that engines built by tests running beside it still depend on their seed alone.
#[cfg(test)]
pub(crate) fn rng_lock() -> std::sync::MutexGuard<'static, ()> {
    RNG_LOCK
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The seed of part `part`'s masks (a layer's or a block's index) in a step of dropout seed
/// `seed`: a distinct stream per part, `seed` mixed with the golden ratio's odd multiple of
/// `part + 1`.
pub(crate) fn mask_seed(seed: u64, part: usize) -> u64 {
    seed ^ (part as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

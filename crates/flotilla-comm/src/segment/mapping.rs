//! One group's shared mapping: its file (created by the group's lowest rank, opened by the
//! others, removed once all have mapped it), its layout and the words of its header.
//!
//! Layout: a header of [`header_bytes`] (magic, size, chunk, then the barrier's words and
//! one line per rank: its progress word and its length word of each set), then two sets
//! (double buffering) of `n` slots, one per rank, each `chunk` bytes.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

use memmap2::MmapRaw;

const MAGIC: u64 = 0x464c_4f54_5348_4d31; // "FLOTSHM1"
const LINE: usize = 64;
/// Offsets of the header's words.
pub(super) const COUNT: usize = LINE;
pub(super) const GENERATION: usize = 2 * LINE;
pub(super) const SLEEPERS: usize = 3 * LINE;
pub(super) const ABORT: usize = 4 * LINE;
/// The aborting rank's error: its length (u32), then its bytes, up to `PROGRESS`.
pub(super) const REASON: usize = 5 * LINE;
pub(super) const REASON_MAX: usize = PROGRESS - REASON - 4;
const PROGRESS: usize = 8 * LINE;

/// Bytes of the header of a segment of `n` ranks (a whole number of pages).
fn header_bytes(n: usize) -> usize {
    (PROGRESS + n * LINE).div_ceil(4096) * 4096
}

/// Bytes of the whole segment of `n` ranks with `chunk`-byte slots.
pub(crate) fn segment_bytes(n: usize, chunk: usize) -> usize {
    header_bytes(n) + 2 * n * chunk
}

/// A mapped segment. The mapping is shared with the other members' processes: what each
/// may touch when is the protocol of `ops.rs`, ordered by the barrier of `sync.rs`.
pub(crate) struct Segment {
    map: MmapRaw,
    /// Members, and this process's group rank.
    pub(crate) n: usize,
    pub(crate) me: usize,
    /// Bytes of one slot.
    pub(crate) chunk: usize,
    /// Steps (barriers) this process has taken on the segment: step `j` uses buffer set
    /// `j % 2` (the protocol of `ops.rs`). Every member takes the same steps in the same
    /// order, so their counts agree; only the collective in its turn touches it.
    pub(super) steps: AtomicUsize,
    /// The longest all-reduce (in floats) that takes one step (`ops.rs`): at most a slot.
    pub(crate) one_step_floats: usize,
    /// Spins of this process's next barrier wait before it yields (`sync.rs`: adapted to
    /// whether spinning paid in the last waits, and capped there; starts uncapped).
    pub(super) spin_budget: AtomicU32,
    /// Whether every member can have a core of its own (then barrier waits spin first):
    /// read once here, since `available_parallelism` reads the cgroup's files each call.
    pub(super) spare_cores: bool,
}

// SAFETY: the mapping is plain memory; concurrent access goes through the header's atomics
// and the slot discipline of `ops.rs`.
unsafe impl Send for Segment {}
// SAFETY: as for `Send`: shared access is through atomics and the slot discipline.
unsafe impl Sync for Segment {}

impl Segment {
    /// Creates the file at `path` (which must not exist), reserves its blocks (so a full
    /// file system fails here, not with SIGBUS later) and maps it.
    pub(crate) fn create(path: &Path, n: usize, me: usize, chunk: usize) -> io::Result<Self> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)?;
        let len = segment_bytes(n, chunk) as u64;
        let reserved = rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), 0, len)
            .map_err(io::Error::from);
        if let Err(e) = reserved.and_then(|()| file.set_len(len)) {
            let _ = std::fs::remove_file(path);
            return Err(e);
        }
        let seg = Self::map(&file, n, me, chunk)?;
        seg.u64_at(8).store(n as u64, Ordering::Relaxed);
        seg.u64_at(16).store(chunk as u64, Ordering::Relaxed);
        seg.u64_at(0).store(MAGIC, Ordering::Release);
        Ok(seg)
    }

    /// Opens and maps the segment another member created at `path`, checking its header.
    pub(crate) fn open(path: &Path, n: usize, me: usize, chunk: usize) -> io::Result<Self> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let len = file.metadata()?.len();
        if len != segment_bytes(n, chunk) as u64 {
            return Err(io::Error::other(format!(
                "{} holds {len} bytes, expected {}",
                path.display(),
                segment_bytes(n, chunk)
            )));
        }
        let seg = Self::map(&file, n, me, chunk)?;
        let header = (
            seg.u64_at(0).load(Ordering::Acquire),
            seg.u64_at(8).load(Ordering::Relaxed),
            seg.u64_at(16).load(Ordering::Relaxed),
        );
        if header != (MAGIC, n as u64, chunk as u64) {
            return Err(io::Error::other(format!(
                "{} is not this group's segment",
                path.display()
            )));
        }
        Ok(seg)
    }

    /// Maps `file` (the mapping outlives the file and its name).
    fn map(file: &File, n: usize, me: usize, chunk: usize) -> io::Result<Self> {
        let map = MmapRaw::map_raw(file)?;
        Ok(Segment {
            map,
            n,
            me,
            chunk,
            steps: AtomicUsize::new(0),
            one_step_floats: 0,
            spin_budget: AtomicU32::new(u32::MAX),
            spare_cores: std::thread::available_parallelism().map_or(1, usize::from) >= n,
        })
    }

    /// Sets the longest all-reduce that takes one step to `bytes` (at most one slot). Every
    /// member must set the same.
    pub(crate) fn with_one_step_bytes(mut self, bytes: usize) -> Self {
        self.one_step_floats = bytes.min(self.chunk) / 4;
        self
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        // Checked in release builds too (once per call).
        assert!(
            off.is_multiple_of(8) && off + 8 <= header_bytes(self.n),
            "segment header word at {off} outside the header"
        );
        // SAFETY: `off` is an aligned offset inside the header (checked above); the mapping
        // is page-aligned and lives as long as `self`.
        unsafe { &*self.map.as_mut_ptr().add(off).cast::<AtomicU64>() }
    }

    /// The header word at `off` (one of the constants above).
    pub(super) fn word(&self, off: usize) -> &AtomicU32 {
        assert!(
            off.is_multiple_of(4) && off + 4 <= header_bytes(self.n),
            "segment header word at {off} outside the header"
        );
        // SAFETY: as `u64_at` (checked above).
        unsafe { &*self.map.as_mut_ptr().add(off).cast::<AtomicU32>() }
    }

    /// Group rank `r`'s progress word: how many barriers it has entered.
    pub(super) fn progress(&self, r: usize) -> &AtomicU32 {
        self.word(PROGRESS + r * LINE)
    }

    /// Group rank `r`'s length word of buffer set `set`: the length of the buffer of the
    /// collective whose first step used that set.
    pub(super) fn len_word(&self, r: usize, set: usize) -> &AtomicU64 {
        self.u64_at(PROGRESS + r * LINE + 8 + 8 * set)
    }

    /// The header bytes at `off..off + len` (the abort reason), raw.
    pub(super) fn header_bytes_at(&self, off: usize, len: usize) -> *mut u8 {
        // Checked in release builds too (once per call).
        assert!(
            off.checked_add(len).is_some_and(|end| end <= PROGRESS),
            "segment header bytes {off}+{len} outside the reason's room"
        );
        // SAFETY: inside the header (checked above).
        unsafe { self.map.as_mut_ptr().add(off) }
    }

    /// The start of rank `r`'s slot of buffer set `set` (0, 1), `chunk / 4` floats, 64-byte
    /// aligned.
    pub(super) fn slot(&self, set: usize, r: usize) -> *mut f32 {
        // Checked in release builds too (once per call): the slot lies inside the mapping.
        assert!(
            set < 2 && r < self.n,
            "segment slot {r} of set {set} outside a segment of {} ranks",
            self.n
        );
        let off = header_bytes(self.n) + (set * self.n + r) * self.chunk;
        // SAFETY: inside the mapping (checked above), whose length is
        // `segment_bytes(n, chunk)`.
        unsafe { self.map.as_mut_ptr().add(off).cast::<f32>() }
    }
}

//! One group's shared mapping: its file (created by the group's lowest rank, opened by the
//! others, removed once all have mapped it), its layout and the words of its header.
//!
//! Layout: a header of [`header_bytes`] (magic, then every parameter of the layout: size,
//! chunk, one-step floats, then the barrier's words and one line per rank: its progress
//! word and its length word of each set), then two sets (double buffering) of `n` slots,
//! one per rank, each `chunk` bytes. A member opening the segment checks every parameter
//! against its own (members configured differently would read each other's slots
//! wrongly), and opens no symbolic link (`O_NOFOLLOW`) and nothing but a regular file.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

use memmap2::MmapRaw;

/// The first word of a segment: "FLOTSHM2" (2: the layout words below, one-step floats
/// included; a segment of another version is refused by its magic).
const MAGIC: u64 = 0x464c_4f54_5348_4d32;
const LINE: usize = 64;
/// The layout words after the magic (u64 each), in [`Layout::words`] order.
const LAYOUT: usize = 8;
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
fn segment_bytes(n: usize, chunk: usize) -> usize {
    header_bytes(n) + 2 * n * chunk
}

/// Every parameter that decides where a member reads and writes in a segment: all members
/// must agree on each, so the creator writes them into the header and every other member
/// checks them on open.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    /// Members of the group.
    pub(crate) n: usize,
    /// Bytes of one slot ([`crate::CommConfig::shm_chunk_bytes`]).
    pub(crate) chunk: usize,
    /// The longest all-reduce (in floats) that takes one step (`ops.rs`): at most a slot.
    pub(crate) one_step_floats: usize,
}

impl Layout {
    /// The layout of a group of `n` with `chunk`-byte slots whose all-reduces up to
    /// `one_step_bytes` take one step ([`crate::CommConfig::small_all_reduce_bytes`]).
    pub(crate) fn new(n: usize, chunk: usize, one_step_bytes: usize) -> Self {
        Layout {
            n,
            chunk,
            one_step_floats: one_step_bytes.min(chunk) / 4,
        }
    }

    /// The header words, each with the setting it comes from (what a mismatch names).
    fn words(&self) -> [(&'static str, u64); 3] {
        [
            ("group size", self.n as u64),
            ("shm_chunk_bytes", self.chunk as u64),
            (
                "one-step floats (small_all_reduce_bytes, at most a slot)",
                self.one_step_floats as u64,
            ),
        ]
    }

    /// Bytes of the whole segment.
    pub(crate) fn bytes(&self) -> usize {
        segment_bytes(self.n, self.chunk)
    }
}

/// Why a member could not open a segment.
#[derive(Debug, thiserror::Error)]
pub(crate) enum OpenError {
    /// The file is not reachable from here as a segment (not found, a symbolic link, not a
    /// regular file, cannot be mapped): this process does not share the creator's
    /// directory, so the group may fall back to TCP.
    #[error("cannot map the shared-memory segment {path}: {source}")]
    Unreachable {
        path: String,
        #[source]
        source: io::Error,
    },
    /// The segment was made for another layout: the members are configured differently.
    #[error("{0}")]
    Mismatch(String),
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
    /// Creates the file at `path` (which must not exist; `O_EXCL` follows no link), reserves
    /// its blocks (so a full file system fails here, not with SIGBUS later), maps it and
    /// writes `layout` into its header.
    pub(crate) fn create(path: &Path, layout: &Layout, me: usize) -> io::Result<Self> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)?;
        let len = layout.bytes() as u64;
        let reserved = rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), 0, len)
            .map_err(io::Error::from);
        let mapped = reserved
            .and_then(|()| file.set_len(len))
            .and_then(|()| Self::map(&file, layout, me));
        let seg = match mapped {
            Ok(seg) => seg,
            Err(e) => {
                let _ = std::fs::remove_file(path);
                return Err(e);
            }
        };
        for (i, (_, v)) in layout.words().into_iter().enumerate() {
            seg.u64_at(LAYOUT + 8 * i).store(v, Ordering::Relaxed);
        }
        seg.u64_at(0).store(MAGIC, Ordering::Release);
        Ok(seg)
    }

    /// Opens and maps the segment another member created at `path` for `layout`: the path
    /// itself, never a symbolic link's target (`O_NOFOLLOW`), a regular file whose header
    /// (read before mapping) holds this version's magic and exactly `layout`.
    pub(crate) fn open(path: &Path, layout: &Layout, me: usize) -> Result<Self, OpenError> {
        let unreachable = |source| OpenError::Unreachable {
            path: path.display().to_string(),
            source,
        };
        let nofollow = rustix::fs::OFlags::NOFOLLOW.bits() as i32;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(nofollow)
            .open(path)
            .map_err(unreachable)?;
        let meta = file.metadata().map_err(unreachable)?;
        if !meta.is_file() {
            return Err(unreachable(io::Error::other("not a regular file")));
        }
        let mut header = [0u8; LAYOUT + 24];
        file.read_exact_at(&mut header, 0).map_err(unreachable)?;
        let word = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&header[i..i + 8]);
            u64::from_ne_bytes(b)
        };
        if word(0) != MAGIC {
            return Err(OpenError::Mismatch(format!(
                "{} is not a shared-memory segment of this Flotilla version",
                path.display()
            )));
        }
        for (i, (what, mine)) in layout.words().into_iter().enumerate() {
            let theirs = word(LAYOUT + 8 * i);
            if theirs != mine {
                return Err(OpenError::Mismatch(format!(
                    "the group's rank 0 made its shared-memory segment with {what} = {theirs}, \
                     this rank has {mine}: every rank of a job needs the same settings"
                )));
            }
        }
        if meta.len() != layout.bytes() as u64 {
            return Err(OpenError::Mismatch(format!(
                "{} holds {} bytes, its layout {}",
                path.display(),
                meta.len(),
                layout.bytes()
            )));
        }
        Self::map(&file, layout, me).map_err(unreachable)
    }

    /// Maps `file` (the mapping outlives the file and its name).
    fn map(file: &File, layout: &Layout, me: usize) -> io::Result<Self> {
        let map = MmapRaw::map_raw(file)?;
        Ok(Segment {
            map,
            n: layout.n,
            me,
            chunk: layout.chunk,
            steps: AtomicUsize::new(0),
            one_step_floats: layout.one_step_floats,
            spin_budget: AtomicU32::new(u32::MAX),
            spare_cores: std::thread::available_parallelism().map_or(1, usize::from) >= layout.n,
        })
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

#[cfg(test)]
mod tests {
    use super::*;

    const LAYOUT_2: Layout = Layout {
        n: 2,
        chunk: 4096,
        one_step_floats: 512,
    };

    #[test]
    fn a_member_opens_the_segment_itself_never_a_planted_symbolic_link() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let real = dir.path().join("segment");
        let made = Segment::create(&real, &LAYOUT_2, 0).expect("create");
        let link = dir.path().join("planted");
        std::os::unix::fs::symlink(&real, &link).expect("symlink");
        match Segment::open(&link, &LAYOUT_2, 1) {
            Err(OpenError::Unreachable { source, .. }) => {
                assert_eq!(
                    source.raw_os_error(),
                    Some(rustix::io::Errno::LOOP.raw_os_error())
                );
            }
            Err(e) => panic!("refused for another reason: {e}"),
            Ok(_) => panic!("the link was followed"),
        }
        // The segment itself opens, and both mappings are one memory.
        let opened = Segment::open(&real, &LAYOUT_2, 1).expect("open the segment");
        made.progress(1).store(7, Ordering::Release);
        assert_eq!(opened.progress(1).load(Ordering::Acquire), 7);
        assert_eq!(opened.one_step_floats, 512);
        // A link planted where rank 0 would create its file is refused too (O_EXCL).
        let err = Segment::create(&link, &LAYOUT_2, 0).err().expect("refused");
        assert_eq!(err.kind(), io::ErrorKind::AlreadyExists);
    }

    #[test]
    fn a_member_with_another_layout_is_refused_naming_the_setting() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let path = dir.path().join("segment");
        let _made = Segment::create(&path, &LAYOUT_2, 0).expect("create");
        let cases = [
            (
                Layout { n: 3, ..LAYOUT_2 },
                "group size = 2, this rank has 3",
            ),
            (
                Layout::new(2, 8192, 2048),
                "shm_chunk_bytes = 4096, this rank has 8192",
            ),
            (
                Layout::new(2, 4096, 1024),
                "small_all_reduce_bytes, at most a slot) = 512, this rank has 256",
            ),
        ];
        for (other, says) in cases {
            match Segment::open(&path, &other, 1) {
                Err(OpenError::Mismatch(m)) => assert!(m.contains(says), "{m}"),
                Err(e) => panic!("{other:?}: refused for another reason: {e}"),
                Ok(_) => panic!("{other:?}: opened"),
            }
        }
    }
}

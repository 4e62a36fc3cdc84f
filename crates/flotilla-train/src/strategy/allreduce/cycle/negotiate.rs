//! The pure core of the background cycle: what a rank announces, how names become ids, and
//! what every rank concludes from the gathered announcements. No I/O here; the cycle
//! thread ([`super::CycleReducer`]) all-gathers one [`Announce`] per rank and feeds them to
//! [`Names::register`] and [`agree`].
//!
//! # Names and ids
//!
//! A tensor is submitted by name. The first time a rank announces a name it sends the name
//! and its length; every rank receives every rank's new names in the same all-gather, so
//! every rank registers the union **sorted by name** and gives the names the next ids in
//! that order. Ids are therefore identical on every rank whatever order the ranks submitted
//! in, and from then on a name costs one bit per cycle.
//!
//! # Readiness
//!
//! A rank's ready set is a bit set over the ids known at the start of the cycle (the same on
//! every rank): bit `i` is set when the rank holds a submitted, unreduced tensor with id `i`.
//! The AND over ranks is what every rank can reduce now; the ids set on some ranks but not
//! all are *partial*, and the ranks missing them are what the stall inspector reports.

use std::collections::{BTreeMap, HashMap};

/// What one rank tells the others in a cycle.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Announce {
    /// The rank asks to stop: its owner asked for shutdown and nothing of it is pending.
    pub stop: bool,
    /// The rank gave up on a stalled tensor; every rank aborts in this cycle.
    pub abort: bool,
    /// Ready bit set over the ids known before this cycle.
    pub ready: Vec<u64>,
    /// Names this rank holds that have no id yet, with their lengths.
    pub new_names: Vec<(String, u64)>,
}

/// Why an announcement could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed cycle announcement: {0}")]
pub struct Malformed(pub String);

impl Announce {
    /// The wire form: flags (1 byte), word count (u32), words (u64 each), name count (u32),
    /// then per name its length in values (u64), its byte length (u32) and its UTF-8 bytes;
    /// all little-endian.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(9 + 8 * self.ready.len());
        out.push(u8::from(self.stop) | (u8::from(self.abort) << 1));
        out.extend_from_slice(&(self.ready.len() as u32).to_le_bytes());
        for w in &self.ready {
            out.extend_from_slice(&w.to_le_bytes());
        }
        out.extend_from_slice(&(self.new_names.len() as u32).to_le_bytes());
        for (name, len) in &self.new_names {
            out.extend_from_slice(&len.to_le_bytes());
            out.extend_from_slice(&(name.len() as u32).to_le_bytes());
            out.extend_from_slice(name.as_bytes());
        }
        out
    }

    /// Parses [`Announce::encode`]'s output.
    pub fn decode(bytes: &[u8]) -> Result<Announce, Malformed> {
        let mut r = Reader { bytes, at: 0 };
        let flags = r.take(1)?[0];
        let words = r.u32()? as usize;
        if words > bytes.len() / 8 {
            return Err(Malformed(format!(
                "{words} ready words in {} bytes",
                bytes.len()
            )));
        }
        let ready = (0..words).map(|_| r.u64()).collect::<Result<Vec<_>, _>>()?;
        let names = r.u32()? as usize;
        if names > bytes.len() / 12 {
            return Err(Malformed(format!("{names} names in {} bytes", bytes.len())));
        }
        let mut new_names = Vec::with_capacity(names);
        for _ in 0..names {
            let len = r.u64()?;
            let n = r.u32()? as usize;
            let name = std::str::from_utf8(r.take(n)?)
                .map_err(|e| Malformed(format!("a name is not UTF-8: {e}")))?;
            new_names.push((name.to_string(), len));
        }
        if r.at != bytes.len() {
            return Err(Malformed(format!(
                "{} bytes after the end",
                bytes.len() - r.at
            )));
        }
        Ok(Announce {
            stop: flags & 1 != 0,
            abort: flags & 2 != 0,
            ready,
            new_names,
        })
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Malformed> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len());
        let end = end.ok_or_else(|| Malformed(format!("truncated at byte {}", self.at)))?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn u32(&mut self) -> Result<u32, Malformed> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64, Malformed> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
}

/// Two ranks announced the same name with different lengths.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LengthMismatch {
    /// The tensor.
    pub name: String,
    /// (rank, length) of each differing announcement, the first one first.
    pub lengths: Vec<(usize, u64)>,
}

/// The registered names, identical on every rank.
#[derive(Debug, Clone, Default)]
pub struct Names {
    ids: HashMap<String, u32>,
    entries: Vec<(String, u64)>,
}

impl Names {
    /// The id of `name`, if registered.
    pub fn id(&self, name: &str) -> Option<u32> {
        self.ids.get(name).copied()
    }

    /// The name and length of `id`.
    pub fn entry(&self, id: u32) -> Option<&(String, u64)> {
        self.entries.get(id as usize)
    }

    /// How many names are registered.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no name is registered.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Registers every rank's new names (element `r` is rank `r`'s announcement): the union,
    /// sorted by name, gets the next ids. A name announced with two different lengths (or
    /// with another length than it was registered with) is refused.
    pub fn register(&mut self, all: &[Announce]) -> Result<(), LengthMismatch> {
        let mut fresh: BTreeMap<&str, Vec<(usize, u64)>> = BTreeMap::new();
        for (rank, a) in all.iter().enumerate() {
            for (name, len) in &a.new_names {
                fresh.entry(name).or_default().push((rank, *len));
            }
        }
        for (name, seen) in fresh {
            let want = match self.id(name) {
                Some(id) => self.entries[id as usize].1,
                None => seen[0].1,
            };
            if seen.iter().any(|&(_, l)| l != want) {
                let mut lengths = seen;
                lengths.retain(|&(_, l)| l != want);
                lengths.insert(0, (usize::MAX, want));
                return Err(LengthMismatch {
                    name: name.to_string(),
                    lengths,
                });
            }
            if self.id(name).is_none() {
                self.ids.insert(name.to_string(), self.entries.len() as u32);
                self.entries.push((name.to_string(), want));
            }
        }
        Ok(())
    }
}

/// What every rank concludes from one cycle's announcements.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Agreement {
    /// Ids ready on every rank, ascending: reduce them now.
    pub ready: Vec<u32>,
    /// Ids ready on some ranks only, with the ranks that do not have them.
    pub partial: Vec<(u32, Vec<usize>)>,
    /// Every rank asked to stop.
    pub all_stop: bool,
    /// Some rank gave up on a stalled tensor.
    pub abort: bool,
}

/// Combines the ranks' announcements (element `r` is rank `r`'s).
pub fn agree(all: &[Announce]) -> Agreement {
    let words = all.iter().map(|a| a.ready.len()).max().unwrap_or(0);
    let word = |a: &Announce, w: usize| a.ready.get(w).copied().unwrap_or(0);
    let mut out = Agreement {
        all_stop: !all.is_empty() && all.iter().all(|a| a.stop),
        abort: all.iter().any(|a| a.abort),
        ..Agreement::default()
    };
    for w in 0..words {
        let and = all.iter().fold(u64::MAX, |acc, a| acc & word(a, w));
        let or = all.iter().fold(0, |acc, a| acc | word(a, w));
        for bit in 0..64 {
            let id = (w * 64 + bit) as u32;
            if and >> bit & 1 == 1 {
                out.ready.push(id);
            } else if or >> bit & 1 == 1 {
                let missing = (0..all.len())
                    .filter(|&r| word(&all[r], w) >> bit & 1 == 0)
                    .collect();
                out.partial.push((id, missing));
            }
        }
    }
    out
}

/// A bit set with the given ids set.
pub fn bits(ids: impl IntoIterator<Item = u32>, known: usize) -> Vec<u64> {
    let mut words = vec![0u64; known.div_ceil(64)];
    for id in ids {
        if let Some(w) = words.get_mut(id as usize / 64) {
            *w |= 1 << (id % 64);
        }
    }
    words
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ann(new: &[(&str, u64)]) -> Announce {
        Announce {
            new_names: new.iter().map(|(n, l)| (n.to_string(), *l)).collect(),
            ..Announce::default()
        }
    }

    #[test]
    fn names_get_the_same_ids_whatever_the_submission_order() {
        let mut a = Names::default();
        let mut b = Names::default();
        // Rank 0 submitted w2 then w1, rank 1 w1 then b; both see the same gather.
        let round = [ann(&[("w2", 4), ("w1", 3)]), ann(&[("w1", 3), ("b", 1)])];
        a.register(&round).expect("lengths agree");
        b.register(&round).expect("lengths agree");
        assert_eq!(
            (a.id("b"), a.id("w1"), a.id("w2")),
            (Some(0), Some(1), Some(2))
        );
        assert_eq!(
            (b.id("b"), b.id("w1"), b.id("w2")),
            (Some(0), Some(1), Some(2))
        );
        // Announced again (another rank was late): keeps its id.
        a.register(&[ann(&[]), ann(&[("w2", 4), ("c", 9)])])
            .expect("same length");
        assert_eq!((a.id("w2"), a.id("c"), a.len()), (Some(2), Some(3), 4));
        assert_eq!(a.entry(3), Some(&("c".to_string(), 9)));
    }

    #[test]
    fn a_name_with_two_lengths_is_refused_naming_them() {
        let mut n = Names::default();
        let err = n
            .register(&[ann(&[("w", 4)]), ann(&[("w", 5)])])
            .expect_err("lengths differ");
        assert_eq!(err.name, "w");
        assert_eq!(err.lengths, vec![(usize::MAX, 4), (1, 5)]);
        n.register(&[ann(&[("v", 2)])]).expect("fine");
        let err = n
            .register(&[ann(&[("v", 3)])])
            .expect_err("registered as 2");
        assert_eq!(err.lengths, vec![(usize::MAX, 2), (0, 3)]);
    }

    #[test]
    fn the_and_is_ready_and_the_rest_names_who_is_missing() {
        let set = |ids: &[u32], stop| Announce {
            ready: bits(ids.iter().copied(), 70),
            stop,
            ..Announce::default()
        };
        let all = [
            set(&[0, 3, 65], true),
            set(&[0, 65, 69], true),
            set(&[0, 3, 65], false),
        ];
        let a = agree(&all);
        assert_eq!(a.ready, vec![0, 65]);
        assert_eq!(a.partial, vec![(3, vec![1]), (69, vec![0, 2])]);
        assert!(!a.all_stop && !a.abort);
        let stops = [set(&[], true), set(&[], true)];
        assert!(agree(&stops).all_stop);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

        #[test]
        fn any_announcement_round_trips(
            stop: bool, abort: bool,
            ready in proptest::collection::vec(proptest::prelude::any::<u64>(), 0..8),
            new_names in proptest::collection::vec(
                (proptest::prelude::any::<String>(), proptest::prelude::any::<u64>()), 0..4),
        ) {
            let a = Announce { stop, abort, ready, new_names };
            proptest::prop_assert_eq!(Announce::decode(&a.encode()), Ok(a));
        }

        #[test]
        fn garbage_is_an_error_or_round_trips(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64),
        ) {
            if let Ok(a) = Announce::decode(&bytes) {
                proptest::prop_assert_eq!(Announce::decode(&a.encode()), Ok(a));
            }
        }
    }

    #[test]
    fn announcements_survive_the_wire_and_garbage_is_refused() {
        let a = Announce {
            stop: true,
            abort: false,
            ready: vec![5, u64::MAX],
            new_names: vec![("layers.0.weight".into(), 150), ("é".into(), 1)],
        };
        let bytes = a.encode();
        assert_eq!(Announce::decode(&bytes), Ok(a));
        for cut in 0..bytes.len() {
            assert!(Announce::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut long = bytes.clone();
        long.push(0);
        assert!(Announce::decode(&long).is_err());
        let mut huge = vec![0u8];
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(Announce::decode(&huge).is_err());
    }
}

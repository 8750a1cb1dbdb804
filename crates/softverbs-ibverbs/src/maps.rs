//! This process's memory mappings (`/proc/self/maps`), read once per registration: whether a
//! range a C caller registers is mapped with the rights the registration needs (the kernel's
//! `ib_umem_get` pins the pages and answers EFAULT otherwise), and whether it is private
//! anonymous memory that `inplace` may move.

/// One line of `/proc/self/maps`.
struct Mapping {
    start: usize,
    end: usize,
    read: bool,
    write: bool,
    /// Private anonymous memory (`rw-p` with no file: the heap or an anonymous mapping).
    private_anon: bool,
}

/// A snapshot of the mappings, sorted by address (as the kernel lists them).
pub struct Mappings(Vec<Mapping>);

impl Mappings {
    /// The current mappings; None when `/proc` cannot be read (no check is possible then).
    pub fn read() -> Option<Mappings> {
        let text = std::fs::read_to_string("/proc/self/maps").ok()?;
        Some(Mappings(text.lines().filter_map(parse).collect()))
    }

    /// True if every byte of `start..end` lies in mappings that `ok` accepts.
    fn all(&self, start: usize, end: usize, ok: impl Fn(&Mapping) -> bool) -> bool {
        let mut covered = start;
        for m in self.0.iter().filter(|m| m.end > start && m.start < end) {
            if m.start > covered || !ok(m) {
                return false;
            }
            covered = m.end;
            if covered >= end {
                return true;
            }
        }
        covered >= end
    }

    /// True if `start..end` is mapped readable, and writable too if `write`: what pinning
    /// the pages for a registration needs.
    pub fn accessible(&self, start: usize, end: usize, write: bool) -> bool {
        self.all(start, end, |m| m.read && (m.write || !write))
    }

    /// True if every byte of `start..end` lies in private anonymous read-write mappings.
    pub fn private_anon(&self, start: usize, end: usize) -> bool {
        self.all(start, end, |m| m.private_anon)
    }
}

/// `start-end perms offset dev inode [path]`.
fn parse(line: &str) -> Option<Mapping> {
    let mut f = line.split_whitespace();
    let (range, perms) = (f.next()?, f.next()?);
    let path = f.nth(3).unwrap_or("");
    let (a, b) = range.split_once('-')?;
    let p = perms.as_bytes();
    Some(Mapping {
        start: usize::from_str_radix(a, 16).ok()?,
        end: usize::from_str_radix(b, 16).ok()?,
        read: p.first() == Some(&b'r'),
        write: p.get(1) == Some(&b'w'),
        private_anon: perms == "rw-p" && (path.is_empty() || path == "[heap]"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn maps(text: &str) -> Mappings {
        Mappings(text.lines().filter_map(parse).collect())
    }

    const MAPS: &str = "\
1000-3000 rw-p 00000000 00:00 0 \n\
3000-4000 r--p 00000000 08:01 42 /usr/lib/x.so\n\
4000-5000 rw-p 00000000 00:00 0 [heap]\n\
6000-7000 ---p 00000000 00:00 0 \n\
7000-8000 rw-s 00000000 00:01 7 /memfd:softverbs-mr (deleted)\n";

    #[test]
    fn ranges_need_every_byte_mapped_with_the_rights_asked() {
        let m = maps(MAPS);
        assert!(m.accessible(0x1000, 0x3000, true));
        assert!(m.accessible(0x1800, 0x3800, false), "across two mappings");
        assert!(
            !m.accessible(0x1800, 0x3800, true),
            "a read-only page inside"
        );
        assert!(
            !m.accessible(0x4800, 0x5800, false),
            "a hole after the heap"
        );
        assert!(!m.accessible(0x6000, 0x6001, false), "PROT_NONE");
        assert!(!m.accessible(0, 0x10, false), "NULL");
        assert!(m.accessible(0x7000, 0x8000, true), "shared memory");
    }

    #[test]
    fn only_private_anonymous_memory_is_movable() {
        let m = maps(MAPS);
        assert!(m.private_anon(0x1000, 0x3000));
        assert!(m.private_anon(0x4000, 0x5000), "the heap");
        assert!(!m.private_anon(0x1000, 0x4000), "a file mapping inside");
        assert!(!m.private_anon(0x7000, 0x8000), "shared");
    }
}

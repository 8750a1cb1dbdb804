//! Registered memory as the transport sees it: a narrow interface the NIC implements over
//! its key table, and a plain model of it for tests.

use super::Sge;

/// A remote access right.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Access {
    Write,
    Read,
    Atomic,
}

/// An atomic operation on 8 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AtomicOp {
    CompareSwap { compare: u64, swap: u64 },
    FetchAdd { add: u64 },
}

/// Why memory could not be reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum MemError {
    #[error("no region has this key")]
    UnknownKey,
    #[error("the region belongs to another protection domain")]
    WrongPd,
    #[error("the region does not grant this access")]
    NoRights,
    #[error("outside the region")]
    OutOfBounds,
    #[error("an atomic needs an 8-byte aligned address")]
    Misaligned,
}

/// Registered memory: remote accesses by R_Key, local ones by L_Key, each checked for the
/// protection domain, the rights and the bounds before a byte moves.
pub trait Memory {
    /// Whether `rkey` lets protection domain `pd` have `access` to `len` bytes at `va`.
    fn check(&self, pd: u32, rkey: u32, va: u64, len: u64, access: Access) -> Result<(), MemError>;
    /// Places `data` at `va` (an RDMA WRITE).
    fn write(&mut self, pd: u32, rkey: u32, va: u64, data: &[u8]) -> Result<(), MemError>;
    /// Reads `out.len()` bytes at `va` (an RDMA READ).
    fn read(&self, pd: u32, rkey: u32, va: u64, out: &mut [u8]) -> Result<(), MemError>;
    /// Executes `op` on the 8 bytes at `va`; returns the value before it.
    fn atomic(&mut self, pd: u32, rkey: u32, va: u64, op: AtomicOp) -> Result<u64, MemError>;
    /// Stores `bytes` into the 8 aligned bytes at `va` in one piece (an RDMA ATOMIC WRITE,
    /// which needs the write right).
    fn atomic_write(&mut self, pd: u32, rkey: u32, va: u64, bytes: [u8; 8])
    -> Result<(), MemError>;
    /// Reads `out.len()` bytes of a message gathered from `sges`, from `offset` into it.
    fn gather(&self, pd: u32, sges: &[Sge], offset: u64, out: &mut [u8]) -> Result<(), MemError>;
    /// Writes `data` into the message buffer `sges` describe, at `offset`.
    fn scatter(&mut self, pd: u32, sges: &[Sge], offset: u64, data: &[u8]) -> Result<(), MemError>;
    /// XRC: the memory (the `pd` argument of the other calls) of SRQ `srqn`, if it is an
    /// XRC SRQ in the domain of the target QP whose memory is `target`; `None` refuses the
    /// request. Memory without XRC SRQs has none.
    fn xrc_srq(&self, target: u32, srqn: u32) -> Option<u32> {
        let _ = (target, srqn);
        None
    }
    /// Invalidates `rkey` (a SEND with invalidate).
    fn invalidate(&mut self, pd: u32, rkey: u32) -> Result<(), MemError>;
    /// An RDMA FLUSH with global placement of `len` bytes at `va` of `rkey` (with
    /// `whole_region`, of all of it): checks the flush right, and returns once what was
    /// placed there before is visible.
    fn flush(
        &mut self,
        pd: u32,
        rkey: u32,
        va: u64,
        len: u64,
        whole_region: bool,
    ) -> Result<(), MemError>;
}

/// A region of [`MemoryModel`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Region {
    pub pd: u32,
    pub lkey: u32,
    pub rkey: u32,
    /// The address of `bytes[0]`.
    pub va: u64,
    pub bytes: Vec<u8>,
    pub remote_write: bool,
    pub remote_read: bool,
    pub remote_atomic: bool,
    pub local_write: bool,
    /// False once invalidated.
    pub valid: bool,
}

impl Region {
    /// A region of `len` zero bytes at `va` with every right, keys `key`.
    pub fn new(pd: u32, key: u32, va: u64, len: usize) -> Region {
        Region {
            pd,
            lkey: key,
            rkey: key,
            va,
            bytes: vec![0; len],
            remote_write: true,
            remote_read: true,
            remote_atomic: true,
            local_write: true,
            valid: true,
        }
    }

    /// The byte range `[va, va + len)` of `bytes`, if inside.
    fn range(&self, va: u64, len: u64) -> Result<std::ops::Range<usize>, MemError> {
        let start = va.checked_sub(self.va).ok_or(MemError::OutOfBounds)?;
        let end = start.checked_add(len).ok_or(MemError::OutOfBounds)?;
        if end > self.bytes.len() as u64 {
            return Err(MemError::OutOfBounds);
        }
        Ok(start as usize..end as usize)
    }
}

/// Registered memory as plain vectors, for tests and the simulator.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemoryModel {
    pub regions: Vec<Region>,
    /// Atomics executed (each exactly once, however often the request arrived).
    pub atomics: u64,
}

impl MemoryModel {
    /// Adds `region`; returns its index.
    pub fn add(&mut self, region: Region) -> usize {
        self.regions.push(region);
        self.regions.len() - 1
    }

    /// The valid region whose key (`key_of` picks the L_Key or the R_Key) is `key`, if it
    /// belongs to protection domain `pd`.
    fn find(&self, pd: u32, key: u32, key_of: fn(&Region) -> u32) -> Result<usize, MemError> {
        let i = self
            .regions
            .iter()
            .position(|r| key_of(r) == key && r.valid)
            .ok_or(MemError::UnknownKey)?;
        if self.regions[i].pd != pd {
            return Err(MemError::WrongPd);
        }
        Ok(i)
    }

    fn by_rkey(&self, pd: u32, rkey: u32) -> Result<usize, MemError> {
        self.find(pd, rkey, |r| r.rkey)
    }

    fn by_lkey(&self, pd: u32, lkey: u32) -> Result<usize, MemError> {
        self.find(pd, lkey, |r| r.lkey)
    }

    /// Walks the part `[offset, offset + len)` of the message `sges` describe, calling `f`
    /// with each piece's region, byte range there, and position in the piece.
    fn walk(
        &self,
        pd: u32,
        sges: &[Sge],
        offset: u64,
        len: usize,
        mut f: impl FnMut(usize, std::ops::Range<usize>, std::ops::Range<usize>) -> Result<(), MemError>,
    ) -> Result<(), MemError> {
        let mut skip = offset;
        let mut done = 0usize;
        for sge in sges {
            if done == len {
                break;
            }
            let sge_len = u64::from(sge.len);
            if skip >= sge_len {
                skip -= sge_len;
                continue;
            }
            let n = ((sge_len - skip) as usize).min(len - done);
            let i = self.by_lkey(pd, sge.lkey)?;
            let range = self.regions[i].range(
                sge.addr.checked_add(skip).ok_or(MemError::OutOfBounds)?,
                n as u64,
            )?;
            f(i, range, done..done + n)?;
            done += n;
            skip = 0;
        }
        if done < len {
            return Err(MemError::OutOfBounds);
        }
        Ok(())
    }
}

impl Memory for MemoryModel {
    fn check(&self, pd: u32, rkey: u32, va: u64, len: u64, access: Access) -> Result<(), MemError> {
        let r = &self.regions[self.by_rkey(pd, rkey)?];
        let allowed = match access {
            Access::Write => r.remote_write,
            Access::Read => r.remote_read,
            Access::Atomic => r.remote_atomic,
        };
        if !allowed {
            return Err(MemError::NoRights);
        }
        if access == Access::Atomic && va % 8 != 0 {
            return Err(MemError::Misaligned);
        }
        r.range(va, len).map(|_| ())
    }

    fn write(&mut self, pd: u32, rkey: u32, va: u64, data: &[u8]) -> Result<(), MemError> {
        self.check(pd, rkey, va, data.len() as u64, Access::Write)?;
        let i = self.by_rkey(pd, rkey)?;
        let range = self.regions[i].range(va, data.len() as u64)?;
        self.regions[i].bytes[range].copy_from_slice(data);
        Ok(())
    }

    fn read(&self, pd: u32, rkey: u32, va: u64, out: &mut [u8]) -> Result<(), MemError> {
        self.check(pd, rkey, va, out.len() as u64, Access::Read)?;
        let r = &self.regions[self.by_rkey(pd, rkey)?];
        out.copy_from_slice(&r.bytes[r.range(va, out.len() as u64)?]);
        Ok(())
    }

    fn atomic(&mut self, pd: u32, rkey: u32, va: u64, op: AtomicOp) -> Result<u64, MemError> {
        self.check(pd, rkey, va, 8, Access::Atomic)?;
        let i = self.by_rkey(pd, rkey)?;
        let range = self.regions[i].range(va, 8)?;
        let cell = &mut self.regions[i].bytes[range];
        let mut b = [0u8; 8];
        b.copy_from_slice(cell);
        let old = u64::from_le_bytes(b);
        let new = match op {
            AtomicOp::CompareSwap { compare, swap } => {
                if old == compare {
                    swap
                } else {
                    old
                }
            }
            AtomicOp::FetchAdd { add } => old.wrapping_add(add),
        };
        cell.copy_from_slice(&new.to_le_bytes());
        self.atomics += 1;
        Ok(old)
    }

    fn atomic_write(
        &mut self,
        pd: u32,
        rkey: u32,
        va: u64,
        bytes: [u8; 8],
    ) -> Result<(), MemError> {
        if va % 8 != 0 {
            return Err(MemError::Misaligned);
        }
        self.write(pd, rkey, va, &bytes)
    }

    /// The model grants FLUSH with the write right (it has no flush bit).
    fn flush(
        &mut self,
        pd: u32,
        rkey: u32,
        va: u64,
        len: u64,
        whole_region: bool,
    ) -> Result<(), MemError> {
        let i = self.by_rkey(pd, rkey)?;
        let r = &self.regions[i];
        if !r.remote_write {
            return Err(MemError::NoRights);
        }
        if !whole_region {
            r.range(va, len)?;
        }
        Ok(())
    }

    fn gather(&self, pd: u32, sges: &[Sge], offset: u64, out: &mut [u8]) -> Result<(), MemError> {
        let len = out.len();
        self.walk(pd, sges, offset, len, |i, src, dst| {
            out[dst].copy_from_slice(&self.regions[i].bytes[src]);
            Ok(())
        })
    }

    fn scatter(&mut self, pd: u32, sges: &[Sge], offset: u64, data: &[u8]) -> Result<(), MemError> {
        let mut pieces = Vec::new();
        self.walk(pd, sges, offset, data.len(), |i, dst, src| {
            pieces.push((i, dst, src));
            Ok(())
        })?;
        for (i, dst, src) in pieces {
            let r = &mut self.regions[i];
            if !r.local_write {
                return Err(MemError::NoRights);
            }
            r.bytes[dst].copy_from_slice(&data[src]);
        }
        Ok(())
    }

    fn invalidate(&mut self, pd: u32, rkey: u32) -> Result<(), MemError> {
        let i = self.by_rkey(pd, rkey)?;
        self.regions[i].valid = false;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_rights_and_bounds_are_checked_before_bytes_move() {
        let mut m = MemoryModel::default();
        m.add(Region::new(1, 10, 0x1000, 64));
        let mut ro = Region::new(1, 11, 0x2000, 16);
        ro.remote_write = false;
        m.add(ro);
        assert_eq!(m.write(1, 10, 0x1000 + 60, &[1; 4]), Ok(()));
        assert_eq!(
            m.write(1, 10, 0x1000 + 61, &[1; 4]),
            Err(MemError::OutOfBounds)
        );
        assert_eq!(m.write(1, 10, 0xfff, &[1]), Err(MemError::OutOfBounds));
        assert_eq!(
            m.write(1, 10, u64::MAX, &[1; 2]),
            Err(MemError::OutOfBounds)
        );
        assert_eq!(m.write(2, 10, 0x1000, &[1]), Err(MemError::WrongPd));
        assert_eq!(m.write(1, 99, 0x1000, &[1]), Err(MemError::UnknownKey));
        assert_eq!(m.write(1, 11, 0x2000, &[1]), Err(MemError::NoRights));
        assert_eq!(
            m.atomic(1, 10, 0x1004, AtomicOp::FetchAdd { add: 1 }),
            Err(MemError::Misaligned)
        );
        assert_eq!(
            m.atomic(1, 10, 0x1008, AtomicOp::FetchAdd { add: 5 }),
            Ok(0)
        );
        assert_eq!(
            m.atomic(
                1,
                10,
                0x1008,
                AtomicOp::CompareSwap {
                    compare: 5,
                    swap: 9
                }
            ),
            Ok(5)
        );
        let mut out = [0u8; 8];
        m.read(1, 10, 0x1008, &mut out).unwrap();
        assert_eq!(u64::from_le_bytes(out), 9);
        assert_eq!(m.atomics, 2);
        assert_eq!(m.regions[0].bytes[60..], [1; 4]);
        m.invalidate(1, 10).unwrap();
        assert_eq!(m.read(1, 10, 0x1000, &mut out), Err(MemError::UnknownKey));
    }

    #[test]
    fn gather_and_scatter_walk_the_sges_from_an_offset() {
        let mut m = MemoryModel::default();
        m.add(Region::new(1, 1, 0, 16));
        m.add(Region::new(1, 2, 100, 16));
        let sges = [
            Sge {
                addr: 2,
                len: 3,
                lkey: 1,
            },
            Sge {
                addr: 104,
                len: 5,
                lkey: 2,
            },
        ];
        m.scatter(1, &sges, 1, &[7, 8, 9, 10]).unwrap();
        assert_eq!(m.regions[0].bytes[2..5], [0, 7, 8]);
        assert_eq!(m.regions[1].bytes[4..7], [9, 10, 0]);
        let mut out = [0u8; 8];
        m.gather(1, &sges, 0, &mut out).unwrap();
        assert_eq!(out, [0, 7, 8, 9, 10, 0, 0, 0]);
        let mut big = [0u8; 9];
        assert_eq!(m.gather(1, &sges, 0, &mut big), Err(MemError::OutOfBounds));
        assert_eq!(m.scatter(1, &sges, 7, &[1, 2]), Err(MemError::OutOfBounds));
        let mut ro = Region::new(1, 3, 200, 4);
        ro.local_write = false;
        m.add(ro);
        assert_eq!(
            m.scatter(
                1,
                &[Sge {
                    addr: 200,
                    len: 4,
                    lkey: 3
                }],
                0,
                &[1]
            ),
            Err(MemError::NoRights)
        );
    }
}

//! What the data path's lock-free protocols share: a thread's identity, the memory barriers
//! the kernel can send to other threads (`membarrier(2)`), which let a rare operation (a
//! deregistration, a second thread taking a QP's send lock) pay for the fence that the
//! frequent one (every request) then leaves out, and whether a process that holds shared
//! state is still there.

pub(crate) mod biased_lock;

use rustix::thread::{MembarrierCommand, membarrier, membarrier_query};
use std::sync::atomic::{AtomicU32, Ordering};

/// A number that tells this thread from every other live thread (the address of a
/// thread-local), never 0 or 1.
#[inline(always)]
pub(crate) fn thread_token() -> usize {
    thread_local! {
        static TOKEN: u64 = const { 0 };
    }
    TOKEN.with(|t| std::ptr::from_ref(t) as usize)
}

/// Which barrier: to the threads of this process, or of every process that registered.
#[derive(Clone, Copy)]
pub(crate) enum Reach {
    /// Every running thread of this process.
    Process,
    /// Every running thread of every process registered for it.
    Host,
}

impl Reach {
    fn commands(self) -> (MembarrierCommand, MembarrierCommand) {
        match self {
            Reach::Process => (
                MembarrierCommand::RegisterPrivateExpedited,
                MembarrierCommand::PrivateExpedited,
            ),
            Reach::Host => (
                MembarrierCommand::RegisterGlobalExpedited,
                MembarrierCommand::GlobalExpedited,
            ),
        }
    }

    fn registration(self) -> &'static AtomicU32 {
        static PROCESS: AtomicU32 = AtomicU32::new(0);
        static HOST: AtomicU32 = AtomicU32::new(0);
        match self {
            Reach::Process => &PROCESS,
            Reach::Host => &HOST,
        }
    }
}

/// The kernel offers barriers of `reach`.
pub(crate) fn offered(reach: Reach) -> bool {
    let q = membarrier_query();
    let (register, barrier) = reach.commands();
    q.contains_command(register) && q.contains_command(barrier)
}

/// This process is registered for barriers of `reach` (false if the kernel refuses).
/// Once per process: a child made by `fork` starts unregistered, so the process id is kept.
pub(crate) fn registered(reach: Reach) -> bool {
    let done = reach.registration();
    let me = std::process::id();
    if done.load(Ordering::Acquire) == me {
        return true;
    }
    let ok = membarrier(reach.commands().0).is_ok();
    if ok {
        done.store(me, Ordering::Release);
    }
    ok
}

/// Every running thread that `reach` covers executes a full memory barrier before this
/// returns (threads not running get one as they are scheduled). For `Reach::Process` the
/// caller registered first; a kernel that refuses the expedited barrier to all processes
/// still has the slow one, which reaches every thread.
pub(crate) fn barrier(reach: Reach) {
    if membarrier(reach.commands().1).is_err() {
        let _ = membarrier(MembarrierCommand::Global);
    }
}

/// Process `pid` exists (running, stopped or a zombie): the kernel does not answer "no such
/// process" to a signal test. A process of another user exists too.
pub(crate) fn process_exists(pid: u32) -> bool {
    // A pid past i32 would name a process group.
    let Some(p) = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
    else {
        return false;
    };
    !matches!(
        rustix::process::test_kill_process(p),
        Err(rustix::io::Errno::SRCH)
    )
}

//! Contexts: a device opened by a program, with its async event queue. PDs, CQs and the rest
//! are created from it by the layers that define them (`Context::alloc_pd`,
//! `Context::create_cq`).

use super::Device;
use super::event::AsyncQueue;
use super::shared::{CommandSegment, Import};
use crate::error::Result;
use std::sync::Arc;

/// An open device (`struct ibv_context`): owns the async event queue and the command
/// descriptor that shares its PDs with other processes ([`Context::cmd_fd`]).
pub struct Context {
    pub(crate) dev: Arc<Device>,
    pub(crate) events: Arc<AsyncQueue>,
    pub(crate) command: CommandSegment,
    /// For a context made by [`Context::import`]: the exporter's key table and memory.
    pub(crate) import: Option<Arc<Import>>,
}

impl Context {
    /// Opens `dev`.
    pub fn open(dev: Arc<Device>) -> Result<Arc<Context>> {
        let command = CommandSegment::new(&dev)?;
        Context::with(dev, command, None)
    }

    pub(crate) fn with(
        dev: Arc<Device>,
        command: CommandSegment,
        import: Option<Arc<Import>>,
    ) -> Result<Arc<Context>> {
        let events = Arc::new(AsyncQueue::new()?);
        dev.attach_context(&events);
        Ok(Arc::new(Context {
            dev,
            events,
            command,
            import,
        }))
    }

    /// The device.
    pub fn device(&self) -> &Arc<Device> {
        &self.dev
    }

    /// The async event queue (its fd is readable while events wait).
    pub fn events(&self) -> &AsyncQueue {
        &self.events
    }
}

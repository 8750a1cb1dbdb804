//! Imported PDs and regions (`ibv_import_pd`, `ibv_import_mr`): a PD of the context this one
//! was imported from ([`Context::import`]), whose keys are the exporter's. What the model is
//! is in [`crate::device`]'s `shared` module.

use super::Pd;
use crate::device::{Context, Resource, Users};
use crate::error::{Error, Result};
use crate::mr::keys::{KeyInfo, KeyTable};
use std::sync::Arc;

impl Context {
    /// `ibv_import_pd`: PD `handle` (its [`Pd::id`]) of the context this one was imported
    /// from. The exporter's QPs and this process's QPs in it check the same keys.
    pub fn import_pd(self: &Arc<Self>, handle: u32) -> Result<Arc<Pd>> {
        let Some(import) = self.import.clone() else {
            return Err(Error::InvalidArgument(
                "ibv_import_pd needs a context made by ibv_import_device".into(),
            ));
        };
        if !self.exports_pd(handle) {
            return Err(Error::NotFound(format!(
                "the exporting context has no PD {handle}"
            )));
        }
        let count = self.dev.acquire(Resource::Pd)?;
        Ok(Arc::new(Pd {
            id: handle,
            ctx: self.clone(),
            users: Users::default(),
            import: Some(import),
            exported: false,
            _count: count,
        }))
    }
}

impl Pd {
    /// `ibv_import_mr`: the region `handle` (its key) of this imported PD, as its owner
    /// registered it. The region stays the owner's: it lives until the owner deregisters it,
    /// and this process's handle is only its description.
    pub fn import_mr(&self, handle: u32) -> Result<KeyInfo> {
        let Some(import) = &self.import else {
            return Err(Error::InvalidArgument(
                "ibv_import_mr needs an imported PD".into(),
            ));
        };
        match import.keys.info(handle) {
            Some(info) if info.pd == self.id => Ok(info),
            _ => Err(Error::NotFound(format!(
                "PD {} has no memory region {handle:#x}",
                self.id
            ))),
        }
    }

    /// True for a PD imported from another context.
    pub fn is_imported(&self) -> bool {
        self.import.is_some()
    }

    /// The key table this PD's keys are in: the device's, or for an imported PD the
    /// exporter's.
    #[inline]
    pub(crate) fn keys(&self) -> &KeyTable {
        match &self.import {
            Some(i) => &i.keys,
            None => &self.ctx.dev.keys,
        }
    }

    /// Registrations go into this process's own table: refused in an imported PD, whose
    /// table belongs to its exporter.
    pub(crate) fn own_keys(&self) -> Result<()> {
        match self.import {
            None => Ok(()),
            Some(_) => Err(Error::Unsupported(
                "registering memory or windows in an imported PD (register them in the \
                 exporting process)"
                    .into(),
            )),
        }
    }
}

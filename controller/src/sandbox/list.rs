//! List: the records of one namespace matching a metadata filter, in name
//! order, by page or all at once.

use std::collections::BTreeMap;

use crate::error::{Error, Result};
use crate::placement::or_default;
use crate::sandbox::Core;
use crate::store::{ListRange, SandboxRecord};

/// A page size as the APIs carry it (signed; 0 = the default); a negative
/// one is refused.
pub fn page_size(requested: i32) -> Result<usize> {
    usize::try_from(requested)
        .map_err(|_| Error::InvalidArgument("page_size must not be negative".into()))
}

impl Core {
    /// One page (`page_size` 0: 500, at most 1000) and the token of the next
    /// (empty on the last page).
    pub fn list(
        &self,
        namespace: &str,
        filter: &BTreeMap<String, String>,
        page_size: usize,
        page_token: &str,
    ) -> Result<(Vec<SandboxRecord>, String)> {
        let ns = or_default(namespace);
        let page_size = match page_size {
            0 => 500,
            n => n.min(1000),
        };
        let after = (!page_token.is_empty()).then_some(page_token);
        // One more than the page: another page only if a match is left.
        // The store answers a filter from its metadata index, so a page
        // costs its own records, not the namespace's.
        let mut out = self.store.list_filtered(
            &ListRange::namespace(ns).after(after).limit(page_size + 1),
            filter,
        )?;
        let next = if out.len() > page_size {
            out.truncate(page_size);
            out.last().map(|r| r.name.clone()).unwrap_or_default()
        } else {
            String::new()
        };
        Ok((out, next))
    }

    /// Every record of a namespace matching `filter`, in name order, in one
    /// answer (the native API's `page_size` 0).
    pub fn list_all(
        &self,
        namespace: &str,
        filter: &BTreeMap<String, String>,
    ) -> Result<Vec<SandboxRecord>> {
        Ok(self
            .store
            .list_filtered(&ListRange::namespace(or_default(namespace)), filter)?)
    }
}

//! List: the records of one namespace matching a metadata filter, in name
//! order, by page or all at once.

use std::collections::BTreeMap;

use crate::error::{Error, Result};
use crate::placement::or_default;
use crate::sandbox::Core;
use crate::store::{ListRange, SandboxRecord};

fn matches(r: &SandboxRecord, filter: &BTreeMap<String, String>) -> bool {
    filter
        .iter()
        .all(|(k, v)| r.spec.metadata.get(k) == Some(v))
}

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
        let chunk_size = page_size.max(64);
        let mut after = (!page_token.is_empty()).then(|| page_token.to_string());
        let mut out = Vec::new();
        loop {
            let chunk = self.store.list(
                &ListRange::namespace(ns)
                    .after(after.as_deref())
                    .limit(chunk_size),
            )?;
            let exhausted = chunk.len() < chunk_size;
            for r in chunk {
                after = Some(r.name.clone());
                if !matches(&r, filter) {
                    continue;
                }
                out.push(r);
                if out.len() == page_size {
                    // Another page only if something is left to read.
                    let more = !self
                        .store
                        .list(&ListRange::namespace(ns).after(after.as_deref()).limit(1))?
                        .is_empty();
                    let next = if more {
                        after.unwrap_or_default()
                    } else {
                        String::new()
                    };
                    return Ok((out, next));
                }
            }
            if exhausted {
                return Ok((out, String::new()));
            }
        }
    }

    /// Every record of a namespace matching `filter`, in name order, in one
    /// answer (the native API's `page_size` 0).
    pub fn list_all(
        &self,
        namespace: &str,
        filter: &BTreeMap<String, String>,
    ) -> Result<Vec<SandboxRecord>> {
        let mut all = self
            .store
            .list(&ListRange::namespace(or_default(namespace)))?;
        all.retain(|r| matches(r, filter));
        Ok(all)
    }
}

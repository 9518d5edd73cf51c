//! `/files/*` and `/directories*`.

use std::collections::HashMap;
use std::fs::{self, File, Metadata};
use std::io::{self, BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::FromRequestParts;
use axum::extract::multipart::{Field, Multipart, MultipartRejection};
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::error::{ApiError, code};
use crate::extract::{ApiResult, JsonBody, Query};
use crate::util::{
    UserDb, lchown, mode_from_api, mode_to_api, resolve_owner, resolve_path, rfc3339,
};

/// Largest `metadata` part of an upload.
const MAX_METADATA: usize = 64 * 1024;
/// Read size of downloads.
const CHUNK: usize = 256 * 1024;

/// `FileInfo` of the contract.
#[derive(Serialize, Debug, Clone)]
pub struct FileInfo {
    pub path: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub size: u64,
    pub modified_at: String,
    pub created_at: String,
    pub owner: String,
    pub group: String,
    pub mode: u32,
}

fn kind_of(md: &Metadata) -> &'static str {
    let ft = md.file_type();
    if ft.is_symlink() {
        "symlink"
    } else if ft.is_dir() {
        "directory"
    } else if ft.is_file() {
        "file"
    } else {
        "other"
    }
}

/// Builds a `FileInfo`; `lmd` is the entry's own (lstat) metadata, `md` what it points to.
fn file_info(path: &Path, lmd: &Metadata, md: Option<&Metadata>, db: &UserDb) -> FileInfo {
    let m = md.unwrap_or(lmd);
    let modified = m.modified().unwrap_or(std::time::UNIX_EPOCH);
    let created = m.created().unwrap_or_else(|_| {
        std::time::UNIX_EPOCH
            + std::time::Duration::new(
                m.ctime().max(0) as u64,
                m.ctime_nsec().clamp(0, 999_999_999) as u32,
            )
    });
    FileInfo {
        path: path.to_string_lossy().into_owned(),
        kind: kind_of(lmd),
        size: if m.is_dir() { 0 } else { m.len() },
        modified_at: rfc3339(modified),
        created_at: rfc3339(created),
        owner: db.user_name(m.uid()),
        group: db.group_name(m.gid()),
        mode: mode_to_api(m.permissions().mode()),
    }
}

fn info_for(path: &Path, db: &UserDb) -> io::Result<FileInfo> {
    let lmd = fs::symlink_metadata(path)?;
    let md = if lmd.file_type().is_symlink() {
        fs::metadata(path).ok()
    } else {
        None
    };
    Ok(file_info(path, &lmd, md.as_ref(), db))
}

/// Runs blocking filesystem work off the async workers.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|e| Err(ApiError::internal(format!("worker failed: {e}"))))
}

/// The repeatable `path` parameter as sent; at least one is required.
fn path_params(q: &Query) -> Result<Vec<String>, ApiError> {
    let raw: Vec<String> = q.all("path").into_iter().map(str::to_string).collect();
    if raw.is_empty() {
        return Err(ApiError::missing_query("path"));
    }
    Ok(raw)
}

fn paths_of(q: &Query) -> Result<Vec<PathBuf>, ApiError> {
    path_params(q)?.iter().map(|p| resolve_path(p)).collect()
}

// ---------------------------------------------------------------- info, delete

/// `GET /files/info?path=...` (repeatable)
#[tracing::instrument(skip_all)]
pub async fn info(q: Query) -> ApiResult<Json<HashMap<String, FileInfo>>> {
    let raw = path_params(&q)?;
    blocking(move || {
        let db = UserDb::load();
        let mut out = HashMap::new();
        for r in raw {
            let p = resolve_path(&r)?;
            let info = info_for(&p, &db).map_err(|e| ApiError::fs(&p, "stat", &e))?;
            out.insert(r, info);
        }
        Ok(Json(out))
    })
    .await
}

/// `DELETE /files?path=...`: removes files (and symlinks); missing ones are fine.
#[tracing::instrument(skip_all)]
pub async fn remove_files(q: Query) -> ApiResult<StatusCode> {
    let paths = paths_of(&q)?;
    blocking(move || {
        for p in paths {
            match fs::symlink_metadata(&p) {
                Ok(md) if md.is_dir() => {
                    return Err(ApiError::bad_request(format!(
                        "{} is a directory; use DELETE /directories",
                        p.display()
                    )));
                }
                Ok(_) => fs::remove_file(&p)
                    .or_else(ignore_missing)
                    .map_err(|e| ApiError::fs(&p, "remove", &e))?,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(ApiError::fs(&p, "stat", &e)),
            }
        }
        Ok(StatusCode::OK)
    })
    .await
}

fn ignore_missing(e: io::Error) -> io::Result<()> {
    if e.kind() == io::ErrorKind::NotFound {
        Ok(())
    } else {
        Err(e)
    }
}

// ---------------------------------------------------------------- permissions, mv, replace

#[derive(Deserialize, Debug, Default)]
#[serde(default)]
pub struct Permission {
    pub owner: Option<String>,
    pub group: Option<String>,
    pub mode: Option<i64>,
}

/// Applies mode and ownership (mode 0 or absent leaves the mode as it is).
fn apply_permission(p: &Path, perm: &Permission, db: &UserDb) -> Result<(), ApiError> {
    let (uid, gid) = resolve_owner(db, perm.owner.as_deref(), perm.group.as_deref())?;
    if let Some(mode) = perm.mode.filter(|m| *m != 0) {
        let mode = mode_from_api(mode)?;
        fs::set_permissions(p, fs::Permissions::from_mode(mode))
            .map_err(|e| ApiError::fs(p, "chmod", &e))?;
    }
    lchown(p, uid, gid).map_err(|e| ApiError::fs(p, "chown", &e))
}

/// `POST /files/permissions` `{path: {owner, group, mode}}`
#[tracing::instrument(skip_all)]
pub async fn chmod(JsonBody(req): JsonBody<HashMap<String, Permission>>) -> ApiResult<StatusCode> {
    with_permissions(req, |p| {
        fs::symlink_metadata(p)
            .map(|_| ())
            .map_err(|e| ApiError::fs(p, "stat", &e))
    })
    .await
}

/// The shared body of the `{path: {owner, group, mode}}` routes: validate
/// every entry first (nothing changes on a bad request), then per path run
/// `prepare` and apply owner and mode.
async fn with_permissions(
    req: HashMap<String, Permission>,
    prepare: fn(&Path) -> Result<(), ApiError>,
) -> ApiResult<StatusCode> {
    let mut items = Vec::new();
    for (k, v) in req {
        if let Some(m) = v.mode {
            mode_from_api(m)?;
        }
        items.push((resolve_path(&k)?, v));
    }
    blocking(move || {
        let db = UserDb::load();
        for (p, perm) in items {
            prepare(&p)?;
            apply_permission(&p, &perm, &db)?;
        }
        Ok(StatusCode::OK)
    })
    .await
}

#[derive(Deserialize)]
pub struct RenameItem {
    src: String,
    dest: String,
}

/// `POST /files/mv` `[{src, dest}]`
#[tracing::instrument(skip_all)]
pub async fn mv(JsonBody(req): JsonBody<Vec<RenameItem>>) -> ApiResult<StatusCode> {
    let items = req
        .into_iter()
        .map(|i| Ok((resolve_path(&i.src)?, resolve_path(&i.dest)?)))
        .collect::<Result<Vec<_>, ApiError>>()?;
    blocking(move || {
        for (src, dest) in items {
            move_one(&src, &dest)?;
        }
        Ok(StatusCode::OK)
    })
    .await
}

/// `rename`, or copy and remove for a regular file on another filesystem.
fn move_one(src: &Path, dest: &Path) -> Result<(), ApiError> {
    fs::symlink_metadata(src).map_err(|e| ApiError::fs(src, "stat", &e))?;
    let Err(e) = fs::rename(src, dest) else {
        return Ok(());
    };
    let is_file = fs::symlink_metadata(src).is_ok_and(|m| m.is_file());
    if e.kind() == io::ErrorKind::CrossesDevices && is_file {
        fs::copy(src, dest).map_err(|e| ApiError::fs(dest, "copy to", &e))?;
        fs::remove_file(src).map_err(|e| ApiError::fs(src, "remove", &e))
    } else {
        Err(ApiError::fs(
            dest,
            &format!("move {} to", src.display()),
            &e,
        ))
    }
}

#[derive(Deserialize)]
pub struct ReplaceItem {
    old: String,
    new: String,
}

#[derive(Serialize)]
struct ReplaceResult {
    #[serde(rename = "replacedCount")]
    replaced_count: usize,
}

/// Replaces every occurrence of `old` by `new`; returns the new bytes and the count.
pub fn replace_all(hay: &[u8], old: &[u8], new: &[u8]) -> (Vec<u8>, usize) {
    if old.is_empty() {
        // An empty pattern "matches" everywhere without advancing: no end.
        return (hay.to_vec(), 0);
    }
    let mut out = Vec::with_capacity(hay.len());
    let mut count = 0;
    let mut i = 0;
    while i < hay.len() {
        if hay.len() - i >= old.len() && &hay[i..i + old.len()] == old {
            out.extend_from_slice(new);
            i += old.len();
            count += 1;
        } else {
            out.push(hay[i]);
            i += 1;
        }
    }
    (out, count)
}

/// `POST /files/replace[?verbose=true]` `{path: {old, new}}`
#[tracing::instrument(skip_all)]
pub async fn replace(
    q: Query,
    JsonBody(req): JsonBody<HashMap<String, ReplaceItem>>,
) -> ApiResult<Response> {
    let verbose = q.flag("verbose");
    let mut items = Vec::new();
    for (k, v) in req {
        if v.old.is_empty() {
            return Err(ApiError::bad_request(format!(
                "{k}: old content must not be empty"
            )));
        }
        items.push((k.clone(), resolve_path(&k)?, v));
    }
    let results = blocking(move || {
        let mut results = HashMap::new();
        for (key, p, item) in items {
            results.insert(key, replace_in_file(&p, &item)?);
        }
        Ok(results)
    })
    .await?;
    Ok(if verbose {
        Json(results).into_response()
    } else {
        StatusCode::OK.into_response()
    })
}

fn replace_in_file(p: &Path, item: &ReplaceItem) -> Result<ReplaceResult, ApiError> {
    let md = fs::metadata(p).map_err(|e| ApiError::fs(p, "stat", &e))?;
    if !md.is_file() {
        return Err(ApiError::bad_request(format!(
            "{} is not a regular file",
            p.display()
        )));
    }
    let data = fs::read(p).map_err(|e| ApiError::fs(p, "read", &e))?;
    let (new, count) = replace_all(&data, item.old.as_bytes(), item.new.as_bytes());
    if count > 0 {
        // In place: keeps inode, owner, mode and hard links.
        fs::write(p, new).map_err(|e| ApiError::fs(p, "write", &e))?;
    }
    Ok(ReplaceResult {
        replaced_count: count,
    })
}

// ---------------------------------------------------------------- search

/// `GET /files/search?path=&pattern=` (pattern default `**`): regular files under `path`
/// whose name matches the glob (or, if the pattern has a `/`, whose path relative to
/// `path` does). Symlinked directories are not followed.
#[tracing::instrument(skip_all)]
pub async fn search(q: Query) -> ApiResult<Json<Vec<FileInfo>>> {
    let root = resolve_path(q.required("path")?)?;
    let pattern = q
        .get("pattern")
        .filter(|p| !p.is_empty())
        .unwrap_or("**")
        .to_string();
    let pat = glob::Pattern::new(&pattern)
        .map_err(|e| ApiError::bad_request(format!("invalid pattern {pattern:?}: {e}")))?;
    blocking(move || {
        let md = fs::metadata(&root).map_err(|e| ApiError::fs(&root, "stat", &e))?;
        if !md.is_dir() {
            return Err(ApiError::bad_request(format!(
                "{} is not a directory",
                root.display()
            )));
        }
        let mut out = find_matching(&root, &pat, pattern.contains('/'));
        out.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(Json(out))
    })
    .await
}

/// Regular files (and symlinks) under `root` matching `pat`, by name or, with
/// `by_path`, by their path relative to `root`. Unreadable directories are skipped.
fn find_matching(root: &Path, pat: &glob::Pattern, by_path: bool) -> Vec<FileInfo> {
    let opts = glob::MatchOptions {
        case_sensitive: true,
        require_literal_separator: by_path,
        require_literal_leading_dot: false,
    };
    let db = UserDb::load();
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(rd) = fs::read_dir(&dir) else { continue };
        let mut entries: Vec<_> = rd.filter_map(Result::ok).collect();
        entries.sort_by_key(|e| e.file_name());
        for e in entries.into_iter().rev() {
            let p = e.path();
            let Ok(lmd) = fs::symlink_metadata(&p) else {
                continue;
            };
            if lmd.is_dir() {
                stack.push(p);
                continue;
            }
            let matched = if by_path {
                p.strip_prefix(root)
                    .is_ok_and(|rel| pat.matches_path_with(rel, opts))
            } else {
                pat.matches_with(&e.file_name().to_string_lossy(), opts)
            };
            if matched {
                let md = if lmd.file_type().is_symlink() {
                    fs::metadata(&p).ok()
                } else {
                    None
                };
                out.push(file_info(&p, &lmd, md.as_ref(), &db));
            }
        }
    }
    out
}

// ---------------------------------------------------------------- directories

/// `GET /directories/list?path=&depth=` (depth default 1; 0 lists nothing). Entries in
/// lexical order, descendants right after their parent, symlinks not followed; a path
/// that is itself a symlink is refused.
#[tracing::instrument(skip_all)]
pub async fn list_dir(q: Query) -> ApiResult<Json<Vec<FileInfo>>> {
    let root = resolve_path(q.required("path")?)?;
    let depth = q.int::<i64>("depth")?.unwrap_or(1);
    if depth < 0 {
        return Err(ApiError::bad_request("depth must not be negative"));
    }
    blocking(move || {
        let lmd = fs::symlink_metadata(&root).map_err(|e| ApiError::fs(&root, "stat", &e))?;
        if lmd.file_type().is_symlink() {
            return Err(ApiError::bad_request(format!(
                "{} is a symbolic link; pass the real directory",
                root.display()
            )));
        }
        if !lmd.is_dir() {
            return Err(ApiError::bad_request(format!(
                "{} is not a directory",
                root.display()
            )));
        }
        let db = UserDb::load();
        let mut out = Vec::new();
        walk(&root, 1, depth as u64, &db, &mut out).map_err(|e| ApiError::fs(&root, "list", &e))?;
        Ok(Json(out))
    })
    .await
}

fn walk(dir: &Path, level: u64, max: u64, db: &UserDb, out: &mut Vec<FileInfo>) -> io::Result<()> {
    if level > max {
        return Ok(());
    }
    let mut entries: Vec<_> = fs::read_dir(dir)?.filter_map(Result::ok).collect();
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let p = e.path();
        let Ok(lmd) = fs::symlink_metadata(&p) else {
            continue;
        };
        out.push(file_info(&p, &lmd, None, db));
        if lmd.is_dir() && level < max {
            // Unreadable subdirectories are listed but not descended into.
            let _ = walk(&p, level + 1, max, db, out);
        }
    }
    Ok(())
}

/// `POST /directories` `{path: {owner, group, mode}}`: `mkdir -p`, then mode and owner
/// of the directory itself.
#[tracing::instrument(skip_all)]
pub async fn make_dirs(
    JsonBody(req): JsonBody<HashMap<String, Permission>>,
) -> ApiResult<StatusCode> {
    with_permissions(req, |p| {
        fs::create_dir_all(p).map_err(|e| ApiError::fs(p, "mkdir", &e))
    })
    .await
}

/// `DELETE /directories?path=...`: `rm -rf`; missing ones are fine.
#[tracing::instrument(skip_all)]
pub async fn remove_dirs(q: Query) -> ApiResult<StatusCode> {
    let paths = paths_of(&q)?;
    blocking(move || {
        for p in paths {
            if p == Path::new("/") {
                return Err(ApiError::bad_request("refusing to delete /"));
            }
            match fs::symlink_metadata(&p) {
                Ok(md) if md.is_dir() => fs::remove_dir_all(&p)
                    .or_else(ignore_missing)
                    .map_err(|e| ApiError::fs(&p, "remove", &e))?,
                Ok(_) => {
                    return Err(ApiError::bad_request(format!(
                        "{} is not a directory; use DELETE /files",
                        p.display()
                    )));
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(ApiError::fs(&p, "stat", &e)),
            }
        }
        Ok(StatusCode::OK)
    })
    .await
}

// ---------------------------------------------------------------- upload

#[derive(Deserialize, Debug, Default)]
#[serde(default)]
struct FileMetadata {
    path: Option<String>,
    owner: Option<String>,
    group: Option<String>,
    mode: Option<i64>,
}

/// A file being written: a temporary sibling renamed over the target at the end, so
/// readers never see half a file.
struct PendingFile {
    target: PathBuf,
    temp: PathBuf,
    perm: Permission,
}

impl PendingFile {
    fn create(target: PathBuf, perm: Permission) -> Result<(Self, File), ApiError> {
        if target == Path::new("/") {
            return Err(ApiError::bad_request("cannot upload to /"));
        }
        if let Ok(md) = fs::symlink_metadata(&target)
            && md.is_dir()
        {
            return Err(ApiError::bad_request(format!(
                "{} is a directory",
                target.display()
            )));
        }
        let parent = target.parent().unwrap_or(Path::new("/")).to_path_buf();
        fs::create_dir_all(&parent).map_err(|e| ApiError::fs(&parent, "mkdir", &e))?;
        let name = target
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        // At most 100 bytes (not chars): the temporary name must fit NAME_MAX
        // (255 bytes) whenever the target's name does.
        let short: String = (name.char_indices())
            .take_while(|(i, c)| i + c.len_utf8() <= 100)
            .map(|(_, c)| c)
            .collect();
        let temp = parent.join(format!(".{short}.execd-{}", crate::commands::new_id()));
        let file = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&temp)
            // Named by the target: the temporary sibling is ours, not the caller's.
            .map_err(|e| ApiError::fs(&target, "create", &e))?;
        Ok((Self { target, temp, perm }, file))
    }

    fn commit(self, db: &UserDb) -> Result<(), ApiError> {
        let r = (|| {
            apply_permission(&self.temp, &self.perm, db)?;
            // A symlink at the target is written through, like `cp` would.
            let dest = match fs::symlink_metadata(&self.target) {
                Ok(md) if md.file_type().is_symlink() => {
                    fs::canonicalize(&self.target).unwrap_or(self.target.clone())
                }
                _ => self.target.clone(),
            };
            fs::rename(&self.temp, &dest).map_err(|e| ApiError::fs(&dest, "rename to", &e))
        })();
        if r.is_err() {
            let _ = fs::remove_file(&self.temp);
        }
        r
    }

    fn abort(self) {
        let _ = fs::remove_file(&self.temp);
    }
}

/// `POST /files/upload`: multipart `metadata` (JSON `{path, owner, group, mode}`, sent as
/// a file part by the SDK) followed by `file`, repeated. Streams to disk.
#[tracing::instrument(skip_all)]
pub async fn upload(multipart: Result<Multipart, MultipartRejection>) -> ApiResult<StatusCode> {
    let mut mp = multipart.map_err(|e| {
        ApiError::bad_request(format!(
            "not a multipart/form-data upload: {}",
            e.body_text()
        ))
    })?;
    let mut meta: Option<FileMetadata> = None;
    let mut written = 0usize;
    while let Some(field) = mp.next_field().await.map_err(malformed_multipart)? {
        match field.name() {
            Some("metadata") => meta = Some(read_metadata_part(field).await?),
            Some("file") => {
                let Some(m) = meta.take() else {
                    return Err(invalid_metadata(
                        "file part without a preceding metadata part",
                    ));
                };
                write_file_part(field, m).await?;
                written += 1;
            }
            other => {
                return Err(ApiError::bad_request(format!(
                    "unexpected multipart part {:?} (want metadata, file)",
                    other.unwrap_or("")
                )));
            }
        }
    }
    if meta.is_some() {
        return Err(invalid_file("metadata part without a following file part"));
    }
    if written == 0 {
        return Err(invalid_file("no file parts in upload"));
    }
    Ok(StatusCode::OK)
}

fn malformed_multipart(e: impl std::fmt::Display) -> ApiError {
    ApiError::bad_request(format!("malformed multipart body: {e}"))
}

fn invalid_metadata(message: impl Into<String>) -> ApiError {
    ApiError::new(
        StatusCode::BAD_REQUEST,
        code::INVALID_FILE_METADATA,
        message,
    )
}

fn invalid_file(message: &str) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, code::INVALID_FILE, message)
}

/// Reads and checks a `metadata` part (bounded: it is held in memory).
async fn read_metadata_part(mut field: Field<'_>) -> Result<FileMetadata, ApiError> {
    let mut data = Vec::new();
    while let Some(chunk) = field.chunk().await.map_err(malformed_multipart)? {
        data.extend_from_slice(&chunk);
        if data.len() > MAX_METADATA {
            return Err(invalid_metadata("metadata part too large"));
        }
    }
    let m: FileMetadata = serde_json::from_slice(&data)
        .map_err(|e| invalid_metadata(format!("invalid metadata JSON: {e}")))?;
    if let Some(mode) = m.mode {
        mode_from_api(mode).map_err(|e| invalid_metadata(e.message))?;
    }
    if m.path.as_deref().is_none_or(|p| p.is_empty()) {
        return Err(invalid_metadata("metadata has no path"));
    }
    Ok(m)
}

/// Streams a `file` part to its target as `m` describes; the target changes only
/// once the whole part arrived.
async fn write_file_part(field: Field<'_>, m: FileMetadata) -> Result<(), ApiError> {
    let target = resolve_path(m.path.as_deref().unwrap_or_default())?;
    let perm = Permission {
        owner: m.owner,
        group: m.group,
        mode: m.mode,
    };
    // Check owner/group before writing anything.
    let (owner, group) = (perm.owner.clone(), perm.group.clone());
    blocking(move || {
        resolve_owner(&UserDb::load(), owner.as_deref(), group.as_deref()).map(|_| ())
    })
    .await?;
    let pending = stream_to_pending_file(field, target, perm).await?;
    blocking(move || pending.commit(&UserDb::load())).await
}

/// How long the rest of a file part is read and discarded after its write failed
/// (a full volume), so that the client, still sending, gets the answer.
const DISCARD_AFTER_FAILURE: std::time::Duration = std::time::Duration::from_secs(60);

/// Copies the part's chunks into a [`PendingFile`] on a blocking writer. On a
/// broken body the pending file is removed and the body's error returned.
async fn stream_to_pending_file(
    mut field: Field<'_>,
    target: PathBuf,
    perm: Permission,
) -> Result<PendingFile, ApiError> {
    let (tx, rx) = mpsc::channel::<Bytes>(16);
    let writer = tokio::task::spawn_blocking(move || write_chunks(target, perm, rx));
    let mut read_err = None;
    loop {
        match field.chunk().await {
            Ok(Some(chunk)) => {
                if tx.send(chunk).await.is_err() {
                    // The writer failed (its error is reported below). Its answer
                    // only reaches a client that is still sending if the rest of
                    // the part is read: answering and closing mid-body makes the
                    // client's next write fail (EPIPE) before it reads anything.
                    let _ = tokio::time::timeout(DISCARD_AFTER_FAILURE, async {
                        while let Ok(Some(_)) = field.chunk().await {}
                    })
                    .await;
                    break;
                }
            }
            Ok(None) => break,
            Err(e) => {
                read_err = Some(malformed_multipart(e));
                break;
            }
        }
    }
    drop(tx);
    let pending = writer
        .await
        .unwrap_or_else(|e| Err(ApiError::internal(format!("writer failed: {e}"))))?;
    if let Some(e) = read_err {
        tokio::task::spawn_blocking(move || pending.abort());
        return Err(e);
    }
    Ok(pending)
}

/// The blocking side of [`stream_to_pending_file`].
fn write_chunks(
    target: PathBuf,
    perm: Permission,
    mut rx: mpsc::Receiver<Bytes>,
) -> Result<PendingFile, ApiError> {
    let (pending, file) = PendingFile::create(target, perm)?;
    let mut w = io::BufWriter::with_capacity(256 * 1024, file);
    let res = (|| {
        while let Some(chunk) = rx.blocking_recv() {
            w.write_all(&chunk)?;
        }
        w.flush()
    })();
    match res {
        Ok(()) => Ok(pending),
        Err(e) => {
            let err = ApiError::fs(&pending.target, "write", &e);
            pending.abort();
            Err(err)
        }
    }
}

// ---------------------------------------------------------------- download

enum Window {
    Full,
    Bytes { start: u64, len: u64 },
    Lines { offset: u64, limit: u64 },
}

/// Parses a single `bytes=` range against `size`. `Ok(None)`: ignore the header (multiple
/// ranges or unknown syntax); `Err(())`: not satisfiable.
pub fn parse_range(h: &str, size: u64) -> Result<Option<(u64, u64)>, ()> {
    let Some(spec) = h.trim().strip_prefix("bytes=") else {
        return Ok(None);
    };
    if spec.contains(',') {
        return Ok(None);
    }
    let Some((a, b)) = spec.trim().split_once('-') else {
        return Ok(None);
    };
    let (a, b) = (a.trim(), b.trim());
    if a.is_empty() {
        let Ok(n) = b.parse::<u64>() else {
            return Ok(None);
        };
        if n == 0 || size == 0 {
            return Err(());
        }
        let n = n.min(size);
        return Ok(Some((size - n, n)));
    }
    let Ok(start) = a.parse::<u64>() else {
        return Ok(None);
    };
    let end = if b.is_empty() {
        size.saturating_sub(1)
    } else {
        match b.parse::<u64>() {
            Ok(e) if e >= start => e.min(size.saturating_sub(1)),
            _ => return Ok(None),
        }
    };
    if start >= size {
        return Err(());
    }
    Ok(Some((start, end - start + 1)))
}

/// What a download asks for: `?path=[&offset=&limit=]` and an optional `Range`.
pub struct DownloadRequest {
    path: PathBuf,
    /// 1-based first line and line count (`offset`/`limit`).
    lines: Option<(u64, u64)>,
    range: Option<String>,
}

impl<S: Send + Sync> FromRequestParts<S> for DownloadRequest {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let q = Query::from_request_parts(parts, state).await?;
        let path = resolve_path(q.required("path")?)?;
        let offset = q.int::<i64>("offset")?;
        let limit = q.int::<i64>("limit")?;
        let range = parts
            .headers
            .get(header::RANGE)
            .map(|v| v.to_str().unwrap_or("").to_string());
        if (offset.is_some() || limit.is_some()) && range.is_some() {
            return Err(ApiError::bad_request(
                "offset/limit and the Range header are mutually exclusive",
            ));
        }
        if offset.is_some_and(|o| o < 1) {
            return Err(ApiError::bad_request(
                "offset must be a positive integer (1-based)",
            ));
        }
        if limit.is_some_and(|l| l < 1) {
            return Err(ApiError::bad_request("limit must be a positive integer"));
        }
        let lines = (offset.is_some() || limit.is_some()).then(|| {
            (
                offset.unwrap_or(1) as u64,
                limit.map(|l| l as u64).unwrap_or(u64::MAX),
            )
        });
        Ok(Self { path, lines, range })
    }
}

/// `GET /files/download?path=[&offset=&limit=]` with optional `Range`.
#[tracing::instrument(skip_all)]
pub async fn download(req: DownloadRequest) -> ApiResult<Response> {
    let path = req.path.clone();
    let (file, size) = blocking(move || open_for_download(&path)).await?;
    let window = match (req.lines, &req.range) {
        (Some((offset, limit)), _) => Window::Lines { offset, limit },
        (None, Some(r)) => match parse_range(r, size) {
            Ok(Some((start, len))) => Window::Bytes { start, len },
            Ok(None) => Window::Full,
            Err(()) => return Ok(range_not_satisfiable(r, size)),
        },
        (None, None) => Window::Full,
    };
    let name = req
        .path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    Ok(stream_window(file, size, window, &name))
}

fn open_for_download(path: &Path) -> Result<(File, u64), ApiError> {
    let file = File::open(path).map_err(|e| ApiError::fs(path, "open", &e))?;
    let md = file
        .metadata()
        .map_err(|e| ApiError::fs(path, "stat", &e))?;
    if md.is_dir() {
        return Err(ApiError::bad_request(format!(
            "{} is a directory",
            path.display()
        )));
    }
    Ok((file, md.len()))
}

fn range_not_satisfiable(range: &str, size: u64) -> Response {
    let mut resp = ApiError::new(
        StatusCode::RANGE_NOT_SATISFIABLE,
        code::RANGE_NOT_SATISFIABLE,
        format!("range {range:?} not satisfiable for {size} bytes"),
    )
    .into_response();
    resp.headers_mut().insert(
        header::CONTENT_RANGE,
        HeaderValue::from_str(&format!("bytes */{size}"))
            .unwrap_or(HeaderValue::from_static("bytes */0")),
    );
    resp
}

/// The answer streaming `window` of `file` (read on a blocking thread).
fn stream_window(file: File, size: u64, window: Window, name: &str) -> Response {
    let (tx, rx) = mpsc::channel::<Result<Bytes, io::Error>>(8);
    let mut resp = Response::new(Body::from_stream(
        tokio_stream::wrappers::ReceiverStream::new(rx),
    ));
    let h = resp.headers_mut();
    match window {
        Window::Lines { offset, limit } => {
            tokio::task::spawn_blocking(move || stream_lines(file, offset, limit, tx));
            h.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; charset=utf-8"),
            );
            return resp;
        }
        Window::Full => {
            tokio::task::spawn_blocking(move || stream_bytes(file, 0, size, tx));
            h.insert(header::CONTENT_LENGTH, HeaderValue::from(size));
        }
        Window::Bytes { start, len } => {
            tokio::task::spawn_blocking(move || stream_bytes(file, start, len, tx));
            h.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
            if let Ok(v) =
                HeaderValue::from_str(&format!("bytes {}-{}/{}", start, start + len - 1, size))
            {
                h.insert(header::CONTENT_RANGE, v);
            }
            *resp.status_mut() = StatusCode::PARTIAL_CONTENT;
        }
    }
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    h.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
    if let Ok(v) = HeaderValue::from_str(&content_disposition(name)) {
        h.insert(header::CONTENT_DISPOSITION, v);
    }
    resp
}

fn content_disposition(name: &str) -> String {
    if name
        .bytes()
        .all(|b| (0x20..0x7f).contains(&b) && b != b'"' && b != b'\\')
    {
        return format!("attachment; filename=\"{name}\"");
    }
    let mut enc = String::new();
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            enc.push(b as char);
        } else {
            enc.push_str(&format!("%{b:02X}"));
        }
    }
    format!("attachment; filename=\"{enc}\"; filename*=UTF-8''{enc}")
}

fn stream_bytes(mut file: File, start: u64, len: u64, tx: mpsc::Sender<Result<Bytes, io::Error>>) {
    if start > 0
        && let Err(e) = file.seek(SeekFrom::Start(start))
    {
        let _ = tx.blocking_send(Err(e));
        return;
    }
    let mut left = len;
    while left > 0 {
        let n = (CHUNK as u64).min(left) as usize;
        let mut buf = vec![0u8; n];
        match file.read(&mut buf) {
            Ok(0) => {
                // The file shrank: the promised length cannot be delivered.
                let _ = tx.blocking_send(Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "file shrank during download",
                )));
                return;
            }
            Ok(got) => {
                buf.truncate(got);
                left -= got as u64;
                if tx.blocking_send(Ok(Bytes::from(buf))).is_err() {
                    return;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                let _ = tx.blocking_send(Err(e));
                return;
            }
        }
    }
}

fn stream_lines(file: File, offset: u64, limit: u64, tx: mpsc::Sender<Result<Bytes, io::Error>>) {
    let mut r = BufReader::with_capacity(CHUNK, file);
    let mut line_no = 1u64;
    let mut sent = 0u64;
    let mut out: Vec<u8> = Vec::with_capacity(CHUNK);
    let mut line = Vec::new();
    while sent < limit {
        line.clear();
        match r.read_until(b'\n', &mut line) {
            Ok(0) => break,
            Ok(_) => {
                if line_no >= offset {
                    out.extend_from_slice(&line);
                    sent += 1;
                    if out.len() >= CHUNK
                        && tx
                            .blocking_send(Ok(Bytes::from(std::mem::take(&mut out))))
                            .is_err()
                    {
                        return;
                    }
                }
                line_no += 1;
            }
            Err(e) => {
                let _ = tx.blocking_send(Err(e));
                return;
            }
        }
    }
    if !out.is_empty() {
        let _ = tx.blocking_send(Ok(Bytes::from(out)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges() {
        assert_eq!(parse_range("bytes=0-9", 100), Ok(Some((0, 10))));
        assert_eq!(parse_range("bytes=90-", 100), Ok(Some((90, 10))));
        assert_eq!(parse_range("bytes=-10", 100), Ok(Some((90, 10))));
        assert_eq!(parse_range("bytes=-1000", 100), Ok(Some((0, 100))));
        assert_eq!(parse_range("bytes=50-1000", 100), Ok(Some((50, 50))));
        assert_eq!(parse_range("bytes=100-", 100), Err(()));
        assert_eq!(parse_range("bytes=-0", 100), Err(()));
        assert_eq!(parse_range("bytes=0-", 0), Err(()));
        assert_eq!(parse_range("bytes=5-1", 100), Ok(None));
        assert_eq!(parse_range("bytes=0-1,5-6", 100), Ok(None));
        assert_eq!(parse_range("items=0-1", 100), Ok(None));
        assert_eq!(parse_range("bytes=x-1", 100), Ok(None));
    }

    #[test]
    fn replacing() {
        assert_eq!(
            replace_all(b"a-a-a", b"a", b"bb"),
            (b"bb-bb-bb".to_vec(), 3)
        );
        assert_eq!(replace_all(b"aaa", b"aa", b"x"), (b"xa".to_vec(), 1));
        assert_eq!(replace_all(b"abc", b"zz", b"x"), (b"abc".to_vec(), 0));
    }

    /// A tmpfs of a few pages; unmounted on drop (also when a test fails).
    struct TinyTmpfs(tempfile::TempDir);

    impl TinyTmpfs {
        fn new() -> TinyTmpfs {
            let dir = tempfile::tempdir().unwrap();
            let st = std::process::Command::new("mount")
                .args(["-t", "tmpfs", "-o", "size=16k", "execd-full-test"])
                .arg(dir.path())
                .status()
                .expect("run mount (unit tests run as root)");
            assert!(st.success(), "mount a tmpfs");
            TinyTmpfs(dir)
        }
    }

    impl Drop for TinyTmpfs {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount")
                .arg(self.0.path())
                .status();
        }
    }

    #[test]
    fn an_upload_to_a_full_volume_answers_507_naming_the_target() {
        let full = TinyTmpfs::new();
        let target = full.0.path().join("big.bin");
        let (tx, rx) = mpsc::channel(2);
        tx.blocking_send(Bytes::from(vec![7u8; 1 << 20])).unwrap();
        drop(tx);
        let err = match write_chunks(target.clone(), Permission::default(), rx) {
            Ok(_) => panic!("1 MiB fit into a 16 KiB filesystem"),
            Err(e) => e,
        };
        assert_eq!(err.status, StatusCode::INSUFFICIENT_STORAGE);
        assert_eq!(
            err.message,
            format!("write {}: no space left on device", target.display())
        );
        // Neither the target nor the temporary sibling is left behind.
        assert_eq!(fs::read_dir(full.0.path()).unwrap().count(), 0);
    }

    #[test]
    fn disposition() {
        assert_eq!(
            content_disposition("a.txt"),
            "attachment; filename=\"a.txt\""
        );
        assert!(content_disposition("é.txt").contains("filename*=UTF-8''%C3%A9.txt"));
    }
}

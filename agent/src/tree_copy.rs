//! A faithful copy of a directory tree, for a snapshot's writable layer.
//!
//! An overlayfs upperdir is a tree in which every detail is data: owners
//! and modes, extended attributes (`trusted.overlay.opaque` marks a
//! directory that hides the image's; security labels and file
//! capabilities), whiteouts (0:0 character devices hiding an image file),
//! other device nodes, fifos, sockets, symlinks, hard links, times. This
//! copies all of it, in process: the agent image is `FROM scratch` (no
//! coreutils `cp`), and a spawned `cp` per capture costs a process for what
//! is a few syscalls per file. File data is cloned (`FICLONE`: shared
//! extents on btrfs and xfs) where the filesystem can, else copied in the
//! kernel (`copy_file_range` through `std::io::copy`). Holes in sparse
//! files are not kept (they are filled with zeros).
//!
//! Blocking: run it on a blocking thread.

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use nix::sys::stat::{Mode, SFlag, UtimensatFlags, mknod, utimensat};
use nix::sys::time::TimeSpec;

/// What a copy did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CopyStats {
    /// Entries made (directories, files, links, nodes), the root excluded.
    pub entries: u64,
    /// Bytes of regular-file data (cloned or copied).
    pub bytes: u64,
    /// Files whose data was cloned rather than copied.
    pub cloned: u64,
}

/// A failed step: the path it was about and what went wrong.
#[derive(Debug, thiserror::Error)]
#[error("{action} {}: {source}", path.display())]
pub struct CopyError {
    pub action: &'static str,
    pub path: PathBuf,
    #[source]
    pub source: io::Error,
}

type Result<T> = std::result::Result<T, CopyError>;

fn at(action: &'static str, path: &Path) -> impl FnOnce(io::Error) -> CopyError + use<> {
    let path = path.to_path_buf();
    move |source| CopyError {
        action,
        path,
        source,
    }
}

fn errno(e: nix::Error) -> io::Error {
    io::Error::from_raw_os_error(e as i32)
}

/// Copies the contents of the directory `from` into the existing, empty
/// directory `to`, and `from`'s own metadata onto `to`. Must run as root
/// (owners, device nodes, `trusted.*` attributes).
pub fn copy_tree(from: &Path, to: &Path) -> Result<CopyStats> {
    let mut copier = Copier::default();
    copier.copy_dir_contents(from, to)?;
    let meta = fs::symlink_metadata(from).map_err(at("stat", from))?;
    copy_metadata(from, to, &meta)?;
    Ok(copier.stats)
}

#[derive(Default)]
struct Copier {
    stats: CopyStats,
    /// (device, inode) of a multiply linked source file → its first copy.
    linked: HashMap<(u64, u64), PathBuf>,
}

impl Copier {
    fn copy_dir_contents(&mut self, from: &Path, to: &Path) -> Result<()> {
        for entry in fs::read_dir(from).map_err(at("read directory", from))? {
            let entry = entry.map_err(at("read directory", from))?;
            let (src, dst) = (entry.path(), to.join(entry.file_name()));
            let meta = fs::symlink_metadata(&src).map_err(at("stat", &src))?;
            self.copy_entry(&src, &dst, &meta)?;
            self.stats.entries += 1;
        }
        Ok(())
    }

    fn copy_entry(&mut self, src: &Path, dst: &Path, meta: &fs::Metadata) -> Result<()> {
        let kind = meta.file_type();
        if kind.is_dir() {
            fs::DirBuilder::new()
                .mode(0o700)
                .create(dst)
                .map_err(at("create directory", dst))?;
            self.copy_dir_contents(src, dst)?;
        } else if kind.is_file() {
            if meta.nlink() > 1 {
                let inode = (meta.dev(), meta.ino());
                if let Some(first) = self.linked.get(&inode) {
                    // A hard link shares the first copy's metadata.
                    return fs::hard_link(first, dst).map_err(at("link", dst));
                }
                self.linked.insert(inode, dst.to_path_buf());
            }
            self.copy_file_data(src, dst, meta)?;
        } else if kind.is_symlink() {
            let target = fs::read_link(src).map_err(at("read link", src))?;
            std::os::unix::fs::symlink(&target, dst).map_err(at("create symlink", dst))?;
        } else {
            make_node(dst, meta)?;
        }
        copy_metadata(src, dst, meta)
    }

    fn copy_file_data(&mut self, src: &Path, dst: &Path, meta: &fs::Metadata) -> Result<()> {
        let mut input = File::open(src).map_err(at("open", src))?;
        let mut output = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(dst)
            .map_err(at("create", dst))?;
        self.stats.bytes += meta.len();
        if meta.len() == 0 {
            return Ok(());
        }
        // SAFETY: FICLONE takes the source descriptor as its argument; both
        // descriptors are open for the duration of the call.
        let cloned =
            unsafe { libc::ioctl(output.as_raw_fd(), libc::FICLONE, input.as_raw_fd()) } == 0;
        if cloned {
            self.stats.cloned += 1;
            return Ok(());
        }
        io::copy(&mut input, &mut output).map_err(at("copy data to", dst))?;
        Ok(())
    }
}

/// A device node, fifo or socket (a whiteout is a 0:0 character device).
fn make_node(dst: &Path, meta: &fs::Metadata) -> Result<()> {
    let kind = meta.file_type();
    let flag = if kind.is_char_device() {
        SFlag::S_IFCHR
    } else if kind.is_block_device() {
        SFlag::S_IFBLK
    } else if kind.is_fifo() {
        SFlag::S_IFIFO
    } else {
        SFlag::S_IFSOCK
    };
    mknod(dst, flag, Mode::from_bits_truncate(0o600), meta.rdev())
        .map_err(|e| at("create node", dst)(errno(e)))
}

/// Owner, then mode (a chown clears set-id bits), extended attributes and
/// times; never through a symlink.
fn copy_metadata(src: &Path, dst: &Path, meta: &fs::Metadata) -> Result<()> {
    std::os::unix::fs::lchown(dst, Some(meta.uid()), Some(meta.gid())).map_err(at("chown", dst))?;
    let is_link = meta.file_type().is_symlink();
    if !is_link {
        fs::set_permissions(dst, fs::Permissions::from_mode(meta.mode() & 0o7777))
            .map_err(at("chmod", dst))?;
    }
    for name in xattr::list(src).map_err(at("list attributes of", src))? {
        if let Some(value) = xattr::get(src, &name).map_err(at("read attribute of", src))? {
            xattr::set(dst, &name, &value).map_err(at("set attribute on", dst))?;
        }
    }
    let atime = TimeSpec::new(meta.atime(), meta.atime_nsec());
    let mtime = TimeSpec::new(meta.mtime(), meta.mtime_nsec());
    utimensat(None, dst, &atime, &mtime, UtimensatFlags::NoFollowSymlink)
        .map_err(|e| at("set times on", dst)(errno(e)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree() -> (tempfile::TempDir, PathBuf, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let (src, dst) = (dir.path().join("src"), dir.path().join("dst"));
        fs::create_dir(&src).unwrap();
        fs::create_dir(&dst).unwrap();
        (dir, src, dst)
    }

    /// Everything an overlay upperdir holds comes across as it was.
    #[test]
    fn copies_every_kind_of_entry_with_its_metadata() {
        let (_dir, src, dst) = tree();
        fs::create_dir_all(src.join("etc/opaque")).unwrap();
        xattr::set(src.join("etc/opaque"), "trusted.overlay.opaque", b"y").unwrap();
        fs::write(src.join("etc/data"), b"hello").unwrap();
        std::os::unix::fs::lchown(src.join("etc/data"), Some(1234), Some(5678)).unwrap();
        fs::set_permissions(src.join("etc/data"), fs::Permissions::from_mode(0o4751)).unwrap();
        fs::hard_link(src.join("etc/data"), src.join("etc/alias")).unwrap();
        std::os::unix::fs::symlink("data", src.join("etc/link")).unwrap();
        mknod(
            &src.join("gone"),
            SFlag::S_IFCHR,
            Mode::from_bits_truncate(0),
            0,
        )
        .unwrap();
        nix::unistd::mkfifo(&src.join("pipe"), Mode::from_bits_truncate(0o644)).unwrap();
        let old = TimeSpec::new(1_000_000, 5);
        utimensat(
            None,
            &src.join("etc/data"),
            &old,
            &old,
            UtimensatFlags::NoFollowSymlink,
        )
        .unwrap();

        let stats = copy_tree(&src, &dst).unwrap();
        assert_eq!(stats.bytes, 5, "a hard-linked file's data is copied once");

        assert_eq!(fs::read(dst.join("etc/data")).unwrap(), b"hello");
        let m = fs::symlink_metadata(dst.join("etc/data")).unwrap();
        assert_eq!((m.uid(), m.gid()), (1234, 5678));
        assert_eq!(m.mode() & 0o7777, 0o4751, "set-id bits survive the chown");
        assert_eq!((m.mtime(), m.mtime_nsec()), (1_000_000, 5));
        let alias = fs::symlink_metadata(dst.join("etc/alias")).unwrap();
        assert_eq!(alias.ino(), m.ino(), "a hard link stays one inode");
        assert_eq!(
            fs::read_link(dst.join("etc/link")).unwrap(),
            PathBuf::from("data")
        );
        assert_eq!(
            xattr::get(dst.join("etc/opaque"), "trusted.overlay.opaque").unwrap(),
            Some(b"y".to_vec())
        );
        let whiteout = fs::symlink_metadata(dst.join("gone")).unwrap();
        assert!(whiteout.file_type().is_char_device());
        assert_eq!(whiteout.rdev(), 0);
        assert!(
            fs::symlink_metadata(dst.join("pipe"))
                .unwrap()
                .file_type()
                .is_fifo()
        );
    }

    #[test]
    fn a_destination_entry_in_the_way_is_an_error_naming_it() {
        let (_dir, src, dst) = tree();
        fs::write(src.join("f"), b"x").unwrap();
        fs::write(dst.join("f"), b"y").unwrap();
        let e = copy_tree(&src, &dst).unwrap_err();
        assert_eq!(e.path, dst.join("f"));
        assert_eq!(e.source.kind(), io::ErrorKind::AlreadyExists);
    }
}

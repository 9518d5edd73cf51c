//! Refuses an execd that cannot run inside a sandbox.
//!
//! execd is bind-mounted (containerd) or copied (Docker) into images that
//! have no dynamic loader and no libc of the host's version, so it must be a
//! static executable for this machine's architecture. A plain `cargo build`
//! makes a dynamically linked one; started as PID 1 of a sandbox it fails
//! before its first instruction and the sandbox dies with "exited with status
//! 1", far away from the cause. Checking the ELF at start turns that into one
//! clear error.
//!
//! The decision follows what the kernel and the loader do: a `PT_INTERP`
//! program header makes the kernel start the named loader, and a `DT_NEEDED`
//! entry in the `PT_DYNAMIC` segment makes that loader look for a library.
//! A static-PIE (what `-C target-feature=+crt-static` gives on the gnu
//! target) has a `PT_DYNAMIC` segment for its self-relocation but neither of
//! the two, so it passes. Only program headers are read: they are what the
//! loader sees, and a stripped binary may have no section headers at all.

use std::fmt;
use std::fs::File;
use std::path::Path;

use object::elf::{
    DT_NEEDED, DT_NULL, DT_STRSZ, DT_STRTAB, ET_DYN, ET_EXEC, FileHeader32, FileHeader64,
    PT_DYNAMIC, PT_LOAD,
};
use object::read::elf::{Dyn, FileHeader, ProgramHeader};
use object::{Endianness, FileKind, ReadCache, ReadRef};

/// What the loader would need to start one ELF file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ElfFacts {
    /// `e_type`: `ET_EXEC`, `ET_DYN` (PIE or shared library), or other.
    pub(crate) e_type: u16,
    /// `e_machine`, e.g. `EM_X86_64`.
    pub(crate) machine: u16,
    /// Whether `e_entry` is set (a shared library usually has none).
    pub(crate) has_entry: bool,
    /// The `PT_INTERP` path, if any.
    pub(crate) interpreter: Option<String>,
    /// `DT_NEEDED` names; `"?"` where the name cannot be resolved (the entry
    /// alone already makes the file dynamic).
    pub(crate) needed: Vec<String>,
}

impl ElfFacts {
    /// Neither a loader nor a library is needed to run it.
    pub(crate) fn is_static(&self) -> bool {
        self.interpreter.is_none() && self.needed.is_empty()
    }
}

#[derive(Debug)]
pub(crate) enum ReadError {
    Io(std::io::Error),
    /// Not an ELF file at all (a script, a text file, another format).
    NotElf,
    /// An ELF file whose headers do not hold together.
    Malformed(String),
}

impl fmt::Display for ReadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReadError::Io(e) => write!(f, "{e}"),
            ReadError::NotElf => f.write_str("not an ELF file"),
            ReadError::Malformed(what) => write!(f, "malformed ELF file: {what}"),
        }
    }
}

impl From<object::read::Error> for ReadError {
    fn from(e: object::read::Error) -> Self {
        ReadError::Malformed(e.to_string())
    }
}

/// Reads the ELF header and program headers of `path` (only those parts of
/// the file, not the whole binary).
pub(crate) fn read_elf(path: &Path) -> Result<ElfFacts, ReadError> {
    let file = File::open(path).map_err(ReadError::Io)?;
    let data = ReadCache::new(file);
    match FileKind::parse(&data) {
        Ok(FileKind::Elf64) => facts::<FileHeader64<Endianness>, _>(&data),
        Ok(FileKind::Elf32) => facts::<FileHeader32<Endianness>, _>(&data),
        // Too short for any magic, or another format.
        _ => Err(ReadError::NotElf),
    }
}

fn facts<'data, Elf: FileHeader<Endian = Endianness>, R: ReadRef<'data>>(
    data: R,
) -> Result<ElfFacts, ReadError> {
    let header = Elf::parse(data)?;
    let endian = header.endian()?;
    let segments = header.program_headers(endian, data)?;

    let mut interpreter = None;
    let mut needed_offsets = Vec::new();
    let mut strtab = None;
    let mut strsz = None;
    for segment in segments {
        if let Some(interp) = segment.interpreter(endian, data)? {
            interpreter = Some(String::from_utf8_lossy(interp).into_owned());
        }
        if segment.p_type(endian) == PT_DYNAMIC {
            let entries = segment.dynamic(endian, data)?.unwrap_or_default();
            for entry in entries {
                match entry.tag(endian) {
                    DT_NULL => break,
                    DT_NEEDED => needed_offsets.push(entry.val(endian)),
                    DT_STRTAB => strtab = Some(entry.val(endian)),
                    DT_STRSZ => strsz = Some(entry.val(endian)),
                    _ => {}
                }
            }
        }
    }

    // The names only make the error readable; the decision rests on the
    // entries themselves, so an unresolvable name is reported as "?".
    let strings = match (strtab, strsz) {
        (Some(addr), Some(size)) => segments
            .iter()
            .filter(|s| s.p_type(endian) == PT_LOAD)
            .find_map(|s| s.data_range(endian, data, addr, size).ok().flatten()),
        _ => None,
    };
    let needed = needed_offsets
        .into_iter()
        .map(|offset| {
            strings
                .and_then(|table| c_string_at(table, offset))
                .unwrap_or_else(|| "?".into())
        })
        .collect();

    Ok(ElfFacts {
        e_type: header.e_type(endian),
        machine: header.e_machine(endian),
        has_entry: Into::<u64>::into(header.e_entry(endian)) != 0,
        interpreter,
        needed,
    })
}

fn c_string_at(table: &[u8], offset: u64) -> Option<String> {
    let rest = table.get(usize::try_from(offset).ok()?..)?;
    let end = rest.iter().position(|&b| b == 0)?;
    Some(String::from_utf8_lossy(&rest[..end]).into_owned())
}

/// `e_machine` of the architecture this binary was built for; `None` where
/// sandbolt has no mapping (the machine check is then skipped).
fn host_machine() -> Option<u16> {
    use object::elf::{EM_386, EM_AARCH64, EM_RISCV, EM_X86_64};
    match std::env::consts::ARCH {
        "x86_64" => Some(EM_X86_64),
        "aarch64" => Some(EM_AARCH64),
        "riscv64" => Some(EM_RISCV),
        "x86" => Some(EM_386),
        _ => None,
    }
}

/// The command that builds the execd this check accepts, as the README and
/// `scripts/build-execd.sh` do.
pub(crate) fn build_hint() -> String {
    format!(
        "build the static one with `scripts/build-execd.sh` (it prints its path; pass that with --execd-bin), \
         i.e. `RUSTFLAGS='-C target-feature=+crt-static' cargo build --profile release-small -p sandbolt-execd --target {}-unknown-linux-gnu`",
        std::env::consts::ARCH
    )
}

/// Why `facts` cannot serve as execd, or `None` when it can.
pub(crate) fn execd_problem(facts: &ElfFacts) -> Option<String> {
    if facts.e_type != ET_EXEC && facts.e_type != ET_DYN {
        return Some(format!(
            "is not an executable (ELF type {}: an object file or a core dump?)",
            facts.e_type
        ));
    }
    if let Some(want) = host_machine()
        && facts.machine != want
    {
        return Some(format!(
            "is built for another architecture (ELF machine {}, this machine is {}: {})",
            facts.machine,
            std::env::consts::ARCH,
            want
        ));
    }
    if !facts.is_static() {
        let mut why = Vec::new();
        if let Some(interp) = &facts.interpreter {
            why.push(format!("loader {interp}"));
        }
        if !facts.needed.is_empty() {
            why.push(format!("libraries {}", facts.needed.join(", ")));
        }
        return Some(format!(
            "is dynamically linked ({}), which a sandbox's image does not provide: every sandbox would die at start",
            why.join("; ")
        ));
    }
    if !facts.has_entry {
        return Some("has no entry point (a shared library?)".into());
    }
    None
}

/// Refuses `path` unless it is a static executable for this machine.
/// `how_chosen` says where the path came from (a flag, or the default beside
/// the binary), so the message points at what to change.
pub(crate) fn require_static_execd(path: &Path, how_chosen: &str) -> anyhow::Result<()> {
    let problem = match read_elf(path) {
        Ok(facts) => execd_problem(&facts),
        Err(ReadError::Io(e)) => {
            return Err(anyhow::Error::new(e).context(format!(
                "reading the execd binary {} ({how_chosen})",
                path.display()
            )));
        }
        Err(ReadError::NotElf) => Some("is not an ELF executable (a script?)".into()),
        Err(e @ ReadError::Malformed(_)) => Some(format!("cannot be read as an executable: {e}")),
    };
    match problem {
        None => Ok(()),
        Some(problem) => anyhow::bail!(
            "execd {} ({how_chosen}) {problem}; {}",
            path.display(),
            build_hint()
        ),
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use object::elf::{EM_X86_64, ET_REL, PT_INTERP};

    use super::*;

    /// A minimal little-endian ELF64 file: header, program headers, and an
    /// optional dynamic segment with the given `DT_NEEDED` names, all inside
    /// one `PT_LOAD` mapped at address 0 so string addresses equal offsets.
    fn tiny_elf(e_type: u16, machine: u16, interp: Option<&str>, needed: &[&str]) -> Vec<u8> {
        const EHDR: usize = 64;
        const PHDR: usize = 56;
        let with_dynamic = !needed.is_empty();
        let phnum = 1 + usize::from(interp.is_some()) + usize::from(with_dynamic);
        let mut tail = Vec::new(); // everything after the program headers
        let base = EHDR + PHDR * phnum;

        let interp_at = base + tail.len();
        if let Some(i) = interp {
            tail.extend_from_slice(i.as_bytes());
            tail.push(0);
        }
        let strtab_at = base + tail.len();
        let mut strtab = vec![0u8];
        let mut name_offsets = Vec::new();
        for name in needed {
            name_offsets.push(strtab.len() as u64);
            strtab.extend_from_slice(name.as_bytes());
            strtab.push(0);
        }
        if with_dynamic {
            tail.extend_from_slice(&strtab);
        }
        while !(base + tail.len()).is_multiple_of(8) {
            tail.push(0);
        }
        let dynamic_at = base + tail.len();
        if with_dynamic {
            let mut entries: Vec<(i64, u64)> =
                name_offsets.iter().map(|&o| (DT_NEEDED, o)).collect();
            entries.push((DT_STRTAB, strtab_at as u64));
            entries.push((DT_STRSZ, strtab.len() as u64));
            entries.push((DT_NULL, 0));
            for (tag, val) in entries {
                tail.extend_from_slice(&tag.to_le_bytes());
                tail.extend_from_slice(&val.to_le_bytes());
            }
        }
        let total = (base + tail.len()) as u64;

        let mut out = Vec::new();
        out.extend_from_slice(&[0x7f, b'E', b'L', b'F', 2, 1, 1, 0]);
        out.extend_from_slice(&[0; 8]);
        out.extend_from_slice(&e_type.to_le_bytes());
        out.extend_from_slice(&machine.to_le_bytes());
        out.extend_from_slice(&1u32.to_le_bytes()); // e_version
        out.extend_from_slice(&0x1000u64.to_le_bytes()); // e_entry
        out.extend_from_slice(&(EHDR as u64).to_le_bytes()); // e_phoff
        out.extend_from_slice(&0u64.to_le_bytes()); // e_shoff: no sections
        out.extend_from_slice(&0u32.to_le_bytes()); // e_flags
        out.extend_from_slice(&(EHDR as u16).to_le_bytes());
        out.extend_from_slice(&(PHDR as u16).to_le_bytes());
        out.extend_from_slice(&(phnum as u16).to_le_bytes());
        out.extend_from_slice(&64u16.to_le_bytes()); // e_shentsize
        out.extend_from_slice(&0u16.to_le_bytes()); // e_shnum
        out.extend_from_slice(&0u16.to_le_bytes()); // e_shstrndx
        assert_eq!(out.len(), EHDR);

        let mut phdr = |p_type: u32, offset: usize, size: u64| {
            out.extend_from_slice(&p_type.to_le_bytes());
            out.extend_from_slice(&4u32.to_le_bytes()); // PF_R
            for v in [offset as u64, offset as u64, offset as u64, size, size, 8] {
                out.extend_from_slice(&v.to_le_bytes());
            }
        };
        phdr(PT_LOAD, 0, total);
        if let Some(i) = interp {
            phdr(PT_INTERP, interp_at, i.len() as u64 + 1);
        }
        if with_dynamic {
            phdr(PT_DYNAMIC, dynamic_at, total - dynamic_at as u64);
        }
        out.extend_from_slice(&tail);
        out
    }

    fn write_temp(bytes: &[u8]) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(bytes).unwrap();
        f.flush().unwrap();
        f
    }

    fn facts_of(bytes: &[u8]) -> Result<ElfFacts, ReadError> {
        read_elf(write_temp(bytes).path())
    }

    #[test]
    fn a_header_without_interpreter_or_needed_is_static() {
        let facts = facts_of(&tiny_elf(ET_EXEC, EM_X86_64, None, &[])).unwrap();
        assert!(facts.is_static(), "{facts:?}");
        assert_eq!(facts.machine, EM_X86_64);
    }

    #[test]
    fn an_interpreter_alone_makes_it_dynamic() {
        let facts = facts_of(&tiny_elf(
            ET_DYN,
            EM_X86_64,
            Some("/lib64/ld-linux-x86-64.so.2"),
            &[],
        ))
        .unwrap();
        assert_eq!(
            facts.interpreter.as_deref(),
            Some("/lib64/ld-linux-x86-64.so.2")
        );
        assert!(!facts.is_static());
    }

    #[test]
    fn a_needed_library_alone_makes_it_dynamic_and_is_named() {
        let facts = facts_of(&tiny_elf(
            ET_EXEC,
            EM_X86_64,
            None,
            &["libc.so.6", "libm.so.6"],
        ))
        .unwrap();
        assert_eq!(facts.interpreter, None);
        assert_eq!(facts.needed, ["libc.so.6", "libm.so.6"]);
        assert!(!facts.is_static());
        let problem = execd_problem(&facts).unwrap();
        assert!(problem.contains("libc.so.6, libm.so.6"), "{problem}");
    }

    #[test]
    fn non_elf_and_truncated_files_are_refused_not_accepted() {
        assert!(matches!(
            facts_of(b"#!/bin/sh\nexec /usr/bin/execd \"$@\"\n"),
            Err(ReadError::NotElf)
        ));
        assert!(matches!(facts_of(b""), Err(ReadError::NotElf)));
        // The header promises program headers the file does not have.
        let whole = tiny_elf(ET_EXEC, EM_X86_64, Some("/lib/ld.so"), &["libc.so.6"]);
        assert!(matches!(
            facts_of(&whole[..80]),
            Err(ReadError::Malformed(_))
        ));
        let f = write_temp(&whole[..80]);
        let err = require_static_execd(f.path(), "--execd-bin").unwrap_err();
        assert!(
            format!("{err:#}").contains("scripts/build-execd.sh"),
            "{err:#}"
        );
    }

    #[test]
    fn object_files_and_foreign_architectures_are_refused() {
        let rel = facts_of(&tiny_elf(ET_REL, EM_X86_64, None, &[])).unwrap();
        assert!(execd_problem(&rel).unwrap().contains("not an executable"));
        // EM_AARCH64 on x86_64, EM_X86_64 anywhere else.
        let foreign = if host_machine() == Some(EM_X86_64) {
            object::elf::EM_AARCH64
        } else {
            EM_X86_64
        };
        let other = facts_of(&tiny_elf(ET_EXEC, foreign, None, &[])).unwrap();
        if host_machine().is_some() {
            assert!(
                execd_problem(&other)
                    .unwrap()
                    .contains("another architecture")
            );
        }
    }

    #[test]
    fn this_test_binary_is_dynamic_and_refused_with_the_build_command() {
        // A normal `cargo build` output: exactly the binary the check exists for.
        let me = std::env::current_exe().unwrap();
        let facts = read_elf(&me).unwrap();
        assert!(facts.interpreter.is_some(), "{facts:?}");
        assert!(
            facts.needed.iter().any(|n| n.starts_with("libc.so")),
            "{facts:?}"
        );
        let err = require_static_execd(&me, "--execd-bin").unwrap_err();
        let msg = format!("{err:#}");
        assert!(msg.contains("dynamically linked"), "{msg}");
        assert!(msg.contains("libc.so"), "{msg}");
        assert!(msg.contains("scripts/build-execd.sh"), "{msg}");
        assert!(msg.contains("+crt-static"), "{msg}");
    }

    #[test]
    fn the_static_execd_is_accepted() {
        // The one scripts/build-execd.sh builds (SANDBOLT_EXECD_BIN, or built
        // by the test bed the same way): a static-PIE with a PT_DYNAMIC
        // segment for self-relocation but no loader and no library.
        let execd = sandbolt_testbed::execd_binary().expect("static execd");
        let facts = read_elf(&execd).unwrap();
        assert!(facts.is_static(), "{facts:?}");
        assert_eq!(execd_problem(&facts), None);
        require_static_execd(&execd, "--execd-bin").unwrap();
    }

    #[test]
    fn a_missing_file_is_an_io_error_naming_the_path() {
        let err = require_static_execd(Path::new("/nonexistent/execd"), "--execd-bin").unwrap_err();
        assert!(format!("{err:#}").contains("/nonexistent/execd"), "{err:#}");
    }
}

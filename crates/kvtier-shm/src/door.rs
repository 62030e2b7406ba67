//! The pool door's wire: how kvtierd hands a registered client its L2 pool, as a file
//! descriptor over a Unix socket (`SCM_RIGHTS`), never as a path the client opens. The
//! daemon's side (who may have which pool) is kvtierd's `pool_door`; this module is the
//! bytes both sides agree on, and the client's blocking fetch. Python's copy of the client
//! is `kvtier/_pool_door.py`.
//!
//! One request and one answer per connection:
//! - request: `KVTPOOL1`, the session id's length (u16 LE, at most [`MAX_SESSION`]), a bearer
//!   token's length (u16 LE, at most [`MAX_TOKEN`]; 0: none), the session id (what `Register`
//!   answered) and the token (a client that registered as a tenant by its token, over TCP,
//!   presents it here too: the door decides the caller's role as the gRPC services do);
//! - answer: `KVTPOOL1`, a status byte (0: the pool, 1: refused), the pool's slots (u32 LE)
//!   and slot stride (u64 LE), a message's length (u16 LE, at most [`MAX_MESSAGE`]) and the
//!   message (UTF-8: why it was refused). The pool's descriptor rides on the answer's
//!   first byte, and only on a status 0 answer.

use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use crate::ShmError;

/// The first bytes of a request and of an answer.
pub const MAGIC: &[u8; 8] = b"KVTPOOL1";
/// The longest session id a request may carry.
pub const MAX_SESSION: usize = 64;
/// The longest bearer token a request may carry.
pub const MAX_TOKEN: usize = 4096;
/// The longest message an answer may carry.
pub const MAX_MESSAGE: usize = 1024;
/// Bytes of a request before the session id.
pub const REQUEST_HEAD: usize = 12;
const ANSWER_HEAD: usize = 8 + 1 + 4 + 8 + 2;

/// What the daemon answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// The pool's descriptor comes with this answer.
    Pool {
        /// Slots in the pool.
        slots: u32,
        /// Bytes per slot.
        stride: u64,
    },
    /// No descriptor, and why.
    Refused(String),
}

/// A request for `session`'s pool, presenting `token` if any.
pub fn request(session: &[u8], token: Option<&str>) -> Result<Vec<u8>, ShmError> {
    if session.is_empty() || session.len() > MAX_SESSION {
        return Err(ShmError::Shape(format!(
            "a session id of {} bytes (1 to {MAX_SESSION})",
            session.len()
        )));
    }
    let token = token.unwrap_or_default().as_bytes();
    if token.len() > MAX_TOKEN {
        return Err(ShmError::Shape(format!(
            "a token of {} bytes (at most {MAX_TOKEN})",
            token.len()
        )));
    }
    let mut b = MAGIC.to_vec();
    b.extend_from_slice(&(session.len() as u16).to_le_bytes());
    b.extend_from_slice(&(token.len() as u16).to_le_bytes());
    b.extend_from_slice(session);
    b.extend_from_slice(token);
    Ok(b)
}

/// The lengths of the session id and the token from a request's first [`REQUEST_HEAD`]
/// bytes.
pub fn request_lens(head: &[u8; REQUEST_HEAD]) -> Result<(usize, usize), String> {
    if &head[..8] != MAGIC {
        return Err("not a kvtier pool door request".into());
    }
    let n = u16::from_le_bytes([head[8], head[9]]) as usize;
    if n == 0 || n > MAX_SESSION {
        return Err(format!("a session id of {n} bytes (1 to {MAX_SESSION})"));
    }
    let t = u16::from_le_bytes([head[10], head[11]]) as usize;
    if t > MAX_TOKEN {
        return Err(format!("a token of {t} bytes (at most {MAX_TOKEN})"));
    }
    Ok((n, t))
}

fn encode(a: &Answer) -> Vec<u8> {
    let (status, slots, stride, msg) = match a {
        Answer::Pool { slots, stride } => (0u8, *slots, *stride, ""),
        Answer::Refused(m) => (1u8, 0, 0, m.as_str()),
    };
    // A message is cut at a character boundary within the bound.
    let mut end = msg.len().min(MAX_MESSAGE);
    while !msg.is_char_boundary(end) {
        end -= 1;
    }
    let mut b = MAGIC.to_vec();
    b.push(status);
    b.extend_from_slice(&slots.to_le_bytes());
    b.extend_from_slice(&stride.to_le_bytes());
    b.extend_from_slice(&(end as u16).to_le_bytes());
    b.extend_from_slice(&msg.as_bytes()[..end]);
    b
}

/// Sends `answer` on `sock`, with `pool`'s descriptor when it is [`Answer::Pool`]. One
/// `sendmsg` on a non-blocking socket: `WouldBlock` means try again when it is writable
/// (the answer is a few dozen bytes, so in practice it never does), and a short send is an
/// error.
pub fn send(sock: BorrowedFd<'_>, answer: &Answer, pool: Option<BorrowedFd<'_>>) -> io::Result<()> {
    let fds: Vec<BorrowedFd<'_>> = match (answer, pool) {
        (Answer::Pool { .. }, Some(fd)) => vec![fd],
        _ => Vec::new(),
    };
    crate::scm::send(sock, &encode(answer), &fds)
}

/// Asks the pool door at `socket` for `session`'s pool, presenting `token` if the client has
/// one: its descriptor, slots and stride. Blocking, within `timeout` for each step. A refusal
/// is [`ShmError::Untrusted`] naming why.
pub fn fetch(
    socket: &Path,
    session: &[u8],
    token: Option<&str>,
    timeout: Duration,
) -> Result<(OwnedFd, u32, u64), ShmError> {
    let at = |op: &'static str| crate::io_err(op, socket);
    let req = request(session, token)?;
    let mut s = UnixStream::connect(socket).map_err(at("connect to the pool door"))?;
    s.set_read_timeout(Some(timeout))
        .map_err(at("set a timeout on"))?;
    s.set_write_timeout(Some(timeout))
        .map_err(at("set a timeout on"))?;
    s.write_all(&req).map_err(at("ask the pool door"))?;
    let (head, fd) = recv_head(&s).map_err(at("read the pool door's answer"))?;
    let bad = |why: String| ShmError::Untrusted {
        path: socket.display().to_string(),
        why,
    };
    if &head[..8] != MAGIC {
        return Err(bad("it is not a kvtier pool door".into()));
    }
    let slots = u32::from_le_bytes([head[9], head[10], head[11], head[12]]);
    let mut st = [0u8; 8];
    st.copy_from_slice(&head[13..21]);
    let stride = u64::from_le_bytes(st);
    let n = u16::from_le_bytes([head[21], head[22]]) as usize;
    if n > MAX_MESSAGE {
        return Err(bad(format!("an answer's message of {n} bytes")));
    }
    let mut msg = vec![0u8; n];
    (&s).read_exact(&mut msg)
        .map_err(at("read the pool door's answer"))?;
    match (head[8], fd) {
        (0, Some(fd)) => Ok((fd, slots, stride)),
        (0, None) => Err(bad("its answer carried no descriptor".into())),
        (1, _) => Err(bad(format!(
            "kvtierd refused: {}",
            String::from_utf8_lossy(&msg)
        ))),
        (other, _) => Err(bad(format!("an answer of status {other}"))),
    }
}

/// Reads the answer's fixed part, and the descriptor that came with it (at most one is
/// kept; any other is closed as it is dropped).
fn recv_head(s: &UnixStream) -> io::Result<([u8; ANSWER_HEAD], Option<OwnedFd>)> {
    use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, recvmsg};
    let mut head = [0u8; ANSWER_HEAD];
    let mut got = 0;
    let mut fd = None;
    while got < ANSWER_HEAD {
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2))];
        let mut anc = RecvAncillaryBuffer::new(&mut space);
        let r = recvmsg(
            s.as_fd(),
            &mut [io::IoSliceMut::new(&mut head[got..])],
            &mut anc,
            RecvFlags::CMSG_CLOEXEC,
        )
        .map_err(io::Error::from)?;
        for m in anc.drain() {
            if let RecvAncillaryMessage::ScmRights(rights) = m {
                for f in rights {
                    if fd.is_none() {
                        fd = Some(f);
                    }
                }
            }
        }
        if r.bytes == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the pool door closed before answering",
            ));
        }
        got += r.bytes;
    }
    Ok((head, fd))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_and_answers_are_bounded_and_checked() {
        let r = request(b"session", Some("tok")).unwrap();
        let mut head = [0u8; REQUEST_HEAD];
        head.copy_from_slice(&r[..REQUEST_HEAD]);
        assert_eq!(request_lens(&head), Ok((7, 3)));
        assert_eq!(&r[REQUEST_HEAD..], b"sessiontok");
        assert!(request(b"", None).is_err());
        assert!(request(&[1; MAX_SESSION + 1], None).is_err());
        assert!(request(b"s", Some(&"t".repeat(MAX_TOKEN + 1))).is_err());
        head[0] = b'X';
        assert!(request_lens(&head).is_err());
        let long = "é".repeat(MAX_MESSAGE);
        let b = encode(&Answer::Refused(long));
        assert!(b.len() <= ANSWER_HEAD + MAX_MESSAGE);
        assert!(std::str::from_utf8(&b[ANSWER_HEAD..]).is_ok());
    }

    #[test]
    fn a_descriptor_crosses_and_a_refusal_names_why() {
        let dir = std::env::temp_dir().join(format!("kvtier-door-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("door.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let pool = std::fs::File::create(dir.join("pool")).unwrap();
        pool.set_len(8192).unwrap();
        let server = std::thread::spawn(move || {
            for answer in [
                Answer::Pool {
                    slots: 2,
                    stride: 4096,
                },
                Answer::Refused("not yours".into()),
            ] {
                let (mut c, _) = listener.accept().unwrap();
                let mut head = [0u8; REQUEST_HEAD];
                c.read_exact(&mut head).unwrap();
                let (n, t) = request_lens(&head).unwrap();
                let mut id = vec![0u8; n + t];
                c.read_exact(&mut id).unwrap();
                assert_eq!(id, b"s1");
                send(c.as_fd(), &answer, Some(pool.as_fd())).unwrap();
            }
        });
        let (fd, slots, stride) = fetch(&path, b"s1", None, Duration::from_secs(5)).unwrap();
        assert_eq!((slots, stride), (2, 4096));
        assert_eq!(std::fs::File::from(fd).metadata().unwrap().len(), 8192);
        let e = fetch(&path, b"s1", None, Duration::from_secs(5)).unwrap_err();
        assert!(e.to_string().contains("not yours"), "{e}");
        server.join().unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

//! A raw HTTP/1.1 client for tests: it sends exactly the request line it is given, so tests
//! see the server's answer byte for byte (status line, headers, body).

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Sends `request_line` (e.g. `GET /metrics HTTP/1.1`) with `Connection: close` and returns
/// the whole response.
pub async fn request(addr: SocketAddr, request_line: &str) -> std::io::Result<String> {
    let mut stream = TcpStream::connect(addr).await?;
    stream
        .write_all(format!("{request_line}\r\nHost: test\r\nConnection: close\r\n\r\n").as_bytes())
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    Ok(response)
}

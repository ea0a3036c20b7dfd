// Durable file writes: what a checkpoint relies on to survive a crash or a power cut.
#pragma once
#include <cstdint>
#include <string>

namespace dtrain {

// Writes `data` to `path` (truncating) and fsyncs it. Throws std::runtime_error with errno.
void write_file_synced(const std::string& path, const std::string& data);
// Writes to a temporary name beside `path`, fsyncs, then renames over `path`.
void write_file_atomic(const std::string& path, const std::string& data);
// fsyncs a directory, making renames and creations inside it durable.
void fsync_dir(const std::string& dir);
// The whole file; throws std::runtime_error naming the path.
std::string read_file(const std::string& path);
// zlib CRC-32 of a file's bytes.
uint32_t crc32_of_file(const std::string& path);

}  // namespace dtrain

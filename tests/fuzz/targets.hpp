// Fuzz targets: the readers that take bytes from outside (the job spec and its validation,
// IDX data files, safetensors files, a checkpoint's manifest and trainer state). Each
// accepts any input: bad input must end in the reader's own dtrain::Error; anything else
// (another exception, a crash, an allocation the input did not pay for) is a bug.
// libfuzzer_main.cpp drives one of them under libFuzzer (scripts/fuzz.sh); test_corpus.cpp
// replays the saved corpus, crashers included, in every test run.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace dtrain::fuzz {

void job_spec(const uint8_t* data, size_t size);
void idx(const uint8_t* data, size_t size);
void safetensors(const uint8_t* data, size_t size);
void checkpoint(const uint8_t* data, size_t size);

}  // namespace dtrain::fuzz

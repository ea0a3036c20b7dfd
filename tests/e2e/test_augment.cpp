// Augmentation and label smoothing through `dtrain run`: an augmented run is the same at 2
// ranks as on one (each sample's draws are its own), resumes bit for bit, and differs from
// the plain run; what does not apply to the data is refused naming the key.
#include <doctest/doctest.h>

#include "run.hpp"

namespace e2e::augment_tests {

namespace {

std::string cnn_job(const std::string& dir) {
  Job j = ranks_job("augment-check", 9);
  j.data = "{dataset: synthetic, samples: 1024, test_samples: 128, input_shape: [1, 12, 12],"
           " classes: 4, batch_size: 32, workers: 2, augment: [random_crop, hflip, erase],"
           " crop_padding: 2}";
  j.model = "{arch: cnn, channels: [8], fc: [16]}";
  j.optimizer = "{name: sgd, lr: 0.05, momentum: 0.9, label_smoothing: 0.1}";
  j.schedule = "{decay: step, step_size: 10}";
  j.max_steps = 20, j.eval_every = 10, j.train = "";
  j.checkpoint = "{every_steps: 10}";
  return j.write(dir, "cnn.yaml");
}

}  // namespace

TEST_SUITE("augment") {
  TEST_CASE("augmented runs: the same at 2 ranks as on one, exact resume, unlike the plain run") {
    auto dir = temp_dir("augment");
    const auto job = cnn_job(dir);
    run_ok("run " + job + " --run-dir " + dir + "/one");
    const auto two = train_whole_and_in_legs(dir, job, 10, " --nproc 2");
    check_losses_close(train_losses(dir + "/one"), two.whole, 1e-4, "augmented, 2 ranks against 1");
    check_same_trajectory(two, 20);
    run_ok("run " + job + " --run-dir " + dir + "/plain --set data.augment=[]");
    run_ok("run " + job + " --run-dir " + dir + "/sharp --set optimizer.label_smoothing=0");
    const auto one = train_losses(dir + "/one");
    CHECK(train_losses(dir + "/plain").at(1) != one.at(1));  // other pixels
    CHECK(train_losses(dir + "/sharp").at(1) != one.at(1));  // another loss
  }

  TEST_CASE("augmentation on tokens or on samples that are not images, and label smoothing on tokens, are refused") {
    auto dir = temp_dir("augment-refuse");
    for (const auto& [sets, says] : std::vector<std::pair<std::string, std::string>>{
             {" --set data.augment=[hflip]", "data.augment: augmentation is for images"},
             {" --set optimizer.label_smoothing=0.1", "optimizer.label_smoothing: for classification only"},
             {" --set data.augment=[rotate]", "data.augment: 'rotate' is not one of random_crop | hflip | erase"}}) {
      auto r = e2e::dtrain("validate " + config("gpt_text.yaml") + sets);
      INFO(sets << ": " << r.err);
      CHECK(r.code == 2);
      CHECK(r.err.find(says) != std::string::npos);
    }
    // Samples that are not images: validate and run refuse them alike, naming the key.
    for (const std::string shape : {"[64]", "[8,8]"}) {
      const std::string sets = " --set data.dataset=synthetic --set data.input_shape=" + shape +
                               " --set model.arch=mlp --set data.augment=[hflip]"
                               " --set train.max_steps=2" + std::string(kQuiet);
      for (const std::string cmd : {"validate", "run"}) {
        auto r = e2e::dtrain(cmd + " " + config("fashion_mnist_mlp.yaml") + sets +
                             (cmd == "run" ? " --run-dir " + dir + "/run" : ""));
        INFO(cmd << sets << ": " << r.err);
        CHECK(r.code == 2);
        CHECK(r.err.find("data.augment: augmentation is for images shaped") != std::string::npos);
      }
    }
  }
}

}  // namespace e2e::augment_tests

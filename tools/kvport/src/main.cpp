// SPDX-License-Identifier: Apache-2.0
#include <iostream>

#include "kvport/cli/cli.hpp"

int main(int argc, char** argv) {
  return kvport::cli::run(argc, argv, std::cout, std::cerr);
}

// dtrain: the executable. Everything it does is dtrain_main's (cli.cpp).
#include "cli.hpp"

int main(int argc, char** argv) { return dtrain_main(argc, argv); }
